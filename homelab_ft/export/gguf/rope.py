"""Where llama.cpp's rotary embedding turns other angles than transformers' for a model homelab-ft
writes, said in RUNNING.md (gguf_arch.runtime_needs) rather than refused: llama.cpp's own
converter writes the same file, no GGUF key changes llama.cpp's arithmetic, and every GGUF of the
family runs so.

The one such case read so far is YaRN's correction range. llama.cpp rounds it to whole rotary
pairs (ggml.c `ggml_rope_yarn_corr_dims`: floorf of the start, ceilf of the end, on every
backend), which transformers does only with `rope_parameters.truncate` true, its default. gpt-oss
sets it false, as OpenAI's reference implementation computes it (vLLM PR 28244 and SGLang PR 14270
added the switch for this model): for gpt-oss-20b's config llama.cpp turns rotary pairs 9-17 of
32 up to 1.76x as fast as transformers, 0.90 rad apart by the 4096 tokens of its original context.
Everything else of YaRN (the ramp between the two bounds, the 0.1 ln(factor) + 1 magnitude) is
the same arithmetic in both, so llama.cpp's angles are transformers' with truncate true (the unit
test transcribes ggml's rope_yarn into numpy to show it).
"""

from __future__ import annotations

from pathlib import Path


def yarn_rounding(model_dir: Path) -> str | None:
    """The RUNNING.md sentence for a YaRN config that does not round its correction range, with
    what llama.cpp's rounding does to this model's angles; None when llama.cpp matches it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    rope = getattr(config, "rope_parameters", None) or {}  # transformers 5: one flat dict for a YaRN model
    if rope.get("rope_type") != "yarn" or rope.get("truncate", True):
        return None
    trained, rounded = yarn_frequencies(config, truncate=False), yarn_frequencies(config, truncate=True)
    moved = [i for i, (a, b) in enumerate(zip(trained, rounded, strict=True)) if abs(b / a - 1) > 1e-6]
    if not moved:
        return None
    speed = max(max(b / a, a / b) for a, b in zip(trained, rounded, strict=True))
    context = int(rope["original_max_position_embeddings"])
    apart = max(abs(b - a) for a, b in zip(trained, rounded, strict=True)) * context
    return (f"llama.cpp rounds YaRN's correction range to whole rotary pairs (ggml_rope_yarn_corr_dims: floor and "
            f"ceil), which this model's config turns off (rope_parameters.truncate = false, as in OpenAI's gpt-oss "
            f"reference code): in llama.cpp, Ollama and LM Studio rotary pairs {moved[0]}-{moved[-1]} of "
            f"{len(trained)} turn up to {speed:.2f}x as fast as in training, {apart:.2f} rad apart by {context} tokens. "
            "Every GGUF of this model runs so, llama.cpp's own converter's included (no GGUF key changes it); "
            "transformers, vLLM and SGLang run it as trained.")


def yarn_frequencies(config, *, truncate: bool) -> list[float]:
    """Each rotary pair's YaRN frequency as transformers computes it (its own `yarn` rope init),
    with the correction range rounded (`truncate`, llama.cpp's arithmetic) or not."""
    import copy

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = copy.deepcopy(config)
    config.rope_parameters = dict(config.rope_parameters, truncate=truncate)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](config)
    return [float(f) for f in inv_freq]
