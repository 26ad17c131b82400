"""Try a model by hand: a chat turn with the model's own chat template (`generate`, and `chat` on a run)."""

from __future__ import annotations

from homelab_ft.model import loading
from homelab_ft.recipe.config import ModelConfig


def chat(model_spec: str, prompt: str, *, system: str | None, max_new_tokens: int, temperature: float) -> str:
    import torch

    model_dir = loading.resolve_model_dir(model_spec)
    model_cfg = ModelConfig(path=model_spec)
    tokenizer = loading.load_tokenizer(model_cfg, model_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = loading.load_model(model_cfg, model_dir, dtype=loading.resolve_dtype("auto", device), device=device)
    return reply(model, tokenizer, turns(prompt, system=system), device=device, max_new_tokens=max_new_tokens,
                 temperature=temperature)


def turns(prompt: str, *, system: str | None, history: tuple[dict, ...] = ()) -> list[dict]:
    """The conversation so far and the new user turn, after the system turn when there is one."""
    return ([{"role": "system", "content": system}] if system else []) + [*history, {"role": "user", "content": prompt}]


def reply(model, tokenizer, messages: list[dict], *, device, max_new_tokens: int, temperature: float,
          chat_template: str | None = None) -> str:
    """The model's next turn: `messages` rendered with `chat_template` (default: the tokenizer's), greedy
    at temperature 0."""
    import torch

    model.eval()
    inputs = tokenizer.apply_chat_template(messages, chat_template=chat_template, add_generation_prompt=True,
                                           tokenize=True, return_tensors="pt", return_dict=True)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        # use_cache: load_model turns the KV cache off for training; a reply wants it (linear, not quadratic)
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, use_cache=True,
                             **sampling)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
