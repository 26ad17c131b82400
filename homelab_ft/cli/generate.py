"""Try a model by hand: a chat turn with the model's own chat template (`generate`, and `chat` on a run).

`--image PATH` (repeatable) puts images in the first user turn of an image-text model's conversation,
read through its processor as training read them (data/images.py: a run's `chat` resizes them with
its data.image_max_pixels / image_min_pixels); a text model is refused in one line before it loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

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


@dataclass(frozen=True)
class Pictures:
    """The images of a conversation (`--image`) and the processor that reads them."""

    processor: object
    images: tuple = field(default_factory=tuple)
    """PIL images, in the order the first user turn shows them."""


def read_pictures(paths, *, model: str, model_dir: Path, model_cfg: ModelConfig, max_pixels: int | None = None,
                  min_pixels: int | None = None) -> Pictures | None:
    """`--image` files read for `model` (None without any): one line for a text model or an
    unreadable file, before the weights load."""
    if not paths:
        return None
    from homelab_ft.data import images as image_files
    from homelab_ft.model import family
    from homelab_ft.rules import vision

    config = family.config_of(model_dir, trust_remote_code=model_cfg.trust_remote_code)
    if vision.image_text_model_class(config) is None:
        raise UserError(f"--image: {model} is a text model (transformers builds no image-text model for "
                        f"{config.model_type}); give an image-text model, or leave --image out")
    read = []
    for path in paths:
        try:
            ref = image_files.resolve(str(path), base_dir=None)
            read.append(image_files.load(ref, max_pixels=max_pixels, min_pixels=min_pixels))
        except image_files.ImageError as err:
            raise UserError(f"--image {path}: {err}") from None
    _, processor = loading.load_tokenizer_and_processor(model_cfg, model_dir, images=True)
    return Pictures(processor=processor, images=tuple(read))


def chat(model_spec: str, prompt: str, *, system: str | None, decoding: Decoding, images: tuple[Path, ...] = ()) -> str:
    import torch

    model_dir = loading.resolve_model_dir(model_spec)
    model_cfg = ModelConfig(path=model_spec)
    pictures = read_pictures(images, model=model_spec, model_dir=model_dir, model_cfg=model_cfg)
    tokenizer = pictures.processor.tokenizer if pictures else loading.load_tokenizer(model_cfg, model_dir)
    check_template(tokenizer, decoding, model=model_spec)  # before the weights load
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = loading.load_model(model_cfg, model_dir, dtype=loading.resolve_dtype("auto", device), device=device,
                               images=pictures is not None)
    return reply(model, tokenizer, turns(prompt, system=system), device=device, decoding=decoding, pictures=pictures)


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


def with_pictures(messages: list[dict], pictures: Pictures | None) -> list[dict]:
    """`messages` with the images as parts before the text of the first user turn."""
    if pictures is None or not pictures.images:
        return messages
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    parts = [{"type": "image"} for _ in pictures.images] + [{"type": "text", "text": messages[first]["content"]}]
    return [*messages[:first], {**messages[first], "content": parts}, *messages[first + 1:]]


def reply(model, tokenizer, messages: list[dict], *, device, decoding: Decoding, pictures: Pictures | None = None) -> str:
    """The model's next turn: `messages` rendered with decoding.chat_template (default: the
    tokenizer's), or the last user turn as plain text with decoding.raw; greedy at temperature 0.
    `pictures`: the images of the first user turn, read with their processor."""
    import torch

    model.eval()
    if pictures is not None and pictures.images:
        if decoding.raw:
            raise UserError("--raw continues the prompt as plain text: it takes no --image (the template places it)")
        text = tokenizer.apply_chat_template(with_pictures(messages, pictures), chat_template=decoding.chat_template,
                                             add_generation_prompt=True, tokenize=False)
        inputs = pictures.processor(text=[text], images=[list(pictures.images)], return_tensors="pt")
    elif decoding.raw:
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
