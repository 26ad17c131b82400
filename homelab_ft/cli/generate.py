"""Try a model by hand: a chat turn with the model's own chat template (`generate`, and `chat` on a run)."""

from __future__ import annotations

from dataclasses import dataclass

from homelab_ft import fsio
from homelab_ft.errors import UserError
from homelab_ft.model import loading
from homelab_ft.recipe.config import ModelConfig


@dataclass(frozen=True)
class Decoding:
    """How a reply is generated and rendered: the flags `generate` and `chat` share (cli/args.sampling)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    """0: greedy."""
    top_p: float = 1.0
    chat_template: str | None = None
    """A Jinja template to render the turns with; None: the tokenizer's own."""
    raw: bool = False
    """No template: the prompt alone, continued as plain text."""

    @classmethod
    def from_args(cls, args) -> Decoding:
        template = fsio.read_text(args.chat_template, what="--chat-template") if args.chat_template else None
        if args.raw and (template or args.system):
            raise UserError("--raw continues the prompt as plain text: it takes no --chat-template and no --system")
        return cls(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   chat_template=template, raw=args.raw)


def chat(model_spec: str, prompt: str, *, system: str | None, decoding: Decoding) -> str:
    import torch

    model_dir = loading.resolve_model_dir(model_spec)
    model_cfg = ModelConfig(path=model_spec)
    tokenizer = loading.load_tokenizer(model_cfg, model_dir)
    check_template(tokenizer, decoding, model=model_spec)  # before the weights load
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = loading.load_model(model_cfg, model_dir, dtype=loading.resolve_dtype("auto", device), device=device)
    return reply(model, tokenizer, turns(prompt, system=system), device=device, decoding=decoding)


def check_template(tokenizer, decoding: Decoding, *, model: str) -> None:
    """A chat turn needs a template: the model's, or one given. Refused in one line otherwise (a base
    model's tokenizer often has none), before any weights load."""
    if decoding.raw or decoding.chat_template or getattr(tokenizer, "chat_template", None):
        return
    raise UserError(f"{model} has no chat template (its tokenizer_config.json sets no chat_template); pass "
                    "--chat-template FILE (a Jinja template), or --raw to continue the prompt as plain text")


def turns(prompt: str, *, system: str | None, history: tuple[dict, ...] = ()) -> list[dict]:
    """The conversation so far and the new user turn, after the system turn when there is one."""
    return ([{"role": "system", "content": system}] if system else []) + [*history, {"role": "user", "content": prompt}]


def reply(model, tokenizer, messages: list[dict], *, device, decoding: Decoding) -> str:
    """The model's next turn: `messages` rendered with decoding.chat_template (default: the
    tokenizer's), or the last user turn as plain text with decoding.raw; greedy at temperature 0."""
    import torch

    model.eval()
    if decoding.raw:
        inputs = tokenizer(messages[-1]["content"], return_tensors="pt")
    else:
        inputs = tokenizer.apply_chat_template(messages, chat_template=decoding.chat_template, add_generation_prompt=True,
                                               tokenize=True, return_tensors="pt", return_dict=True)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    sampling = ({"do_sample": True, "temperature": decoding.temperature, "top_p": decoding.top_p}
                if decoding.temperature > 0 else {"do_sample": False})
    with torch.no_grad():
        # use_cache: load_model turns the KV cache off for training; a reply wants it (linear, not quadratic)
        out = model.generate(**inputs, max_new_tokens=decoding.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             use_cache=True, **sampling)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
