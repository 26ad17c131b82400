"""What a model family can do, read from the class transformers builds for its config.

transformers declares per model class whether it runs scaled-dot-product attention
(`_supports_sdpa`), flash attention (`_supports_flash_attn`), activation checkpointing
(`supports_gradient_checkpointing`) and which module is its repeated block (`_no_split_modules`,
the FSDP unit). Everything here reads those flags from the class, before a weight is read, so a
rung the family cannot run is refused in one line naming the family and what to use instead, not
with a traceback from inside transformers after the run directory exists.
"""

from __future__ import annotations

import logging
from pathlib import Path

from homelab_ft.errors import UserError
from homelab_ft.locate import config_refusal

log = logging.getLogger(__name__)

AUTO = "auto"


def causal_lm_class(config, *, images: bool = False) -> type | None:
    """The class a run builds for `config` (rules/vision.model_class: the causal LM, or the image-text
    model on an image run or where transformers maps no causal LM), or None for remote code (a config
    with `auto_map`) and configs transformers maps to neither."""
    from homelab_ft.rules import vision

    return vision.model_class(config, images=images)


def attention(requested: str, *, config, say: bool = True, images: bool = False) -> str | None:
    """The `attn_implementation` to load `config`'s model with for `model.attn_implementation`.

    `auto`: sdpa where the class supports it, else eager: the order transformers' own
    `get_correct_attn_implementation` falls back in when given none (Gemma 2 and gpt-oss have no
    sdpa in transformers 5.24: their soft-capped / sink attention is eager or flash only); flash
    attention is never picked unasked, it needs the flash-attn package and a CUDA GPU. An explicit
    choice the class does not support is refused. None (remote code): transformers decides.
    `say` logs what `auto` chose (the load does; the preflight check only refuses).
    """
    cls = causal_lm_class(config, images=images)
    if cls is None:
        return None if requested == AUTO else requested
    chosen = ("sdpa" if cls._supports_sdpa else "eager") if requested == AUTO else requested
    supported = {"eager": True, "sdpa": cls._supports_sdpa, "flash_attention_2": cls._supports_flash_attn}
    if not supported.get(chosen, False):
        raise UserError(
            f"model.attn_implementation: {config.model_type} ({cls.__name__}) does not support {chosen}; "
            f"set model.attn_implementation: auto (here {'sdpa' if cls._supports_sdpa else 'eager'})"
        )
    if requested == AUTO and say:
        # The expected choice (sdpa) is a debug detail; a fallback to eager, slower and heavier at
        # long sequences, is worth a line. (`chat` prints its replies on stdout beside the log.)
        (log.debug if chosen == "sdpa" else log.info)(
            "attention: %s (model.attn_implementation auto; %s %s sdpa)", chosen, cls.__name__,
            "supports" if cls._supports_sdpa else "has no")
    return chosen


def config_of(model_dir, *, trust_remote_code: bool):
    """config.json as transformers reads it (`AutoConfig`), refused in one line where it cannot."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except OSError as err:
        raise UserError(f"model.path: transformers cannot read {model_dir}/config.json: "
                        f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    except Exception as err:  # noqa: BLE001 - a config transformers refuses; anything else re-raised
        refusal = config_refusal(err, Path(model_dir) / "config.json")
        if refusal is None:
            raise
        raise refusal from None


def check(config, *, attn_implementation: str, activation_checkpointing: bool, sharded: bool,
          images: bool = False) -> None:
    """Refuse, from the class alone, what this family cannot do on the rung (see the module docstring)."""
    attention(attn_implementation, config=config, say=False, images=images)
    cls = causal_lm_class(config, images=images)
    if cls is None:
        return  # remote code: checked on the loaded model (blocks.py)
    if activation_checkpointing and not cls.supports_gradient_checkpointing:
        raise UserError(f"{config.model_type} ({cls.__name__}) does not support activation checkpointing; "
                        "set train.activation_checkpointing: false")
    if sharded and not _declares_blocks(cls, config):
        raise UserError(f"{config.model_type} ({cls.__name__}) declares no transformer block (`_no_split_modules`), "
                        "so FSDP cannot shard it; use sharding.strategy: no_shard (DDP) or one GPU")


def _declares_blocks(cls, config) -> bool:
    """`cls` names its blocks, or (an image-text model composed of parts, Llava's) its language model
    does: decoder_blocks.py collects `_no_split_modules` from every module, so the parts' count."""
    if cls._no_split_modules:
        return True
    text = config.get_text_config(decoder=True)
    return text is not config and bool(getattr(causal_lm_class(text), "_no_split_modules", None))
