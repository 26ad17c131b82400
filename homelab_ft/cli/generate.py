"""Try a model by hand: one chat turn with the model's own chat template."""

from __future__ import annotations

from homelab_ft.config import ModelConfig
from homelab_ft.model import loading


def chat(model_spec: str, prompt: str, *, system: str | None, max_new_tokens: int, temperature: float) -> str:
    import torch

    model_dir = loading.resolve_model_dir(model_spec)
    model_cfg = ModelConfig(path=model_spec)
    tokenizer = loading.load_tokenizer(model_cfg, model_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = loading.load_model(model_cfg, model_dir, dtype=loading.resolve_dtype("auto", device), device=device)
    model.eval()
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_tensors="pt", return_dict=True)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
