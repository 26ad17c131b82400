"""Read a written GGUF back through transformers' GGUF loader and compare it with its source.

transformers' reader (`modeling_gguf_pytorch_utils.load_gguf_checkpoint`, behind
`from_pretrained(..., gguf_file=...)`) is an implementation independent of our writer: it undoes
llama.cpp's q/k permutation and Gemma's norm offset with its own code, and builds the tokenizer
from the metadata with its own code. What it reads back is compared with the model the GGUF was
written from: hyperparameters, tokenizer ids and chat template, every tensor bit for bit (against
the source rounded as meant), and the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from homelab_ft.export.gguf_arch import FAMILIES
from homelab_ft.export.gguf_export import tensor_qtype

GGUF_BOUNDS = {"f32": 1e-5, "f16": 0.01, "bf16": 0.05, "q8_0": 0.1}
"""Max |logit difference| between the GGUF reloaded by transformers and the model it was written
from, per unit of the largest |logit| (flat when logits stay within +-1). Measured on SmolLM2-135M
(logits up to ~41): f32 0, f16 0.001, bf16 0.007, q8_0 0.036 per unit; so f32 must be identical
and the others have 3-10x margin. 4-bit rounding moves SmolLM2's logits by up to 0.6 per unit, so
q4_0/q5_1 get no logit bound (one that cannot fail checks nothing): for them (as for every type)
the check that counts is the exact tensor comparison in `_check_tensors`, and what the rounding
costs is measured on the run's eval rows by gguf_quality."""

PROBE_CHATS = (
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in the format ANSWER: <value>."},
     {"role": "user", "content": "Is 2 + 2 = 4? Reply yes or no."},
     {"role": "assistant", "content": "ANSWER: yes"},
     {"role": "user", "content": "and 17 * 3 = 51?  (two  spaces)\nnew line, café"}],
)


@dataclass(frozen=True)
class GgufCheck:
    max_abs_diff: float
    bound: float | None
    """GGUF_BOUNDS[type] scaled by the largest |logit|; None for a type without a bound."""

    def describe(self) -> str:
        bound = f"bound {self.bound:.2e}" if self.bound is not None else "no logit bound for 4-bit types"
        return f"max |logit difference| GGUF vs merged model = {self.max_abs_diff:.2e} ({bound})"


def verify_gguf(gguf_path: Path, reference_dir: Path, *, gguf_type: str) -> GgufCheck:
    """Reload the GGUF through transformers' GGUF loader and compare it with `reference_dir`.

    Checked: the hyperparameters transformers reads from the metadata, the tokenizer (same ids on
    chat-formatted prompts with special tokens added as the model adds them, same chat template),
    and the logits on those prompts within GGUF_BOUNDS[gguf_type] where it has one. The weights are loaded into the
    reference's config: transformers' GGUF reader does not read rope scaling or Qwen3's head size,
    which llama.cpp does read from the keys written above. Raises RuntimeError on a mismatch.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gguf-check-") as alone:
        # Alone in its folder: beside tokenizer.json / tokenizer_config.json (a safetensors,gguf
        # export) transformers 5.24 builds the tokenizer from those files and not from the GGUF.
        (Path(alone) / Path(gguf_path).name).symlink_to(Path(gguf_path).resolve())
        return _verify(Path(alone), Path(gguf_path).name, Path(reference_dir), gguf_type=gguf_type)


def _verify(folder: Path, file: str, reference_dir: Path, *, gguf_type: str) -> GgufCheck:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    reference_config = AutoConfig.from_pretrained(reference_dir)
    reference_tok = AutoTokenizer.from_pretrained(reference_dir)
    gguf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    if reference_tok.chat_template != gguf_tok.chat_template:
        raise RuntimeError("GGUF check failed: the chat template in the GGUF differs from the tokenizer's")
    probes = []
    for chat in PROBE_CHATS:
        text = reference_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        want, got = reference_tok(text)["input_ids"], gguf_tok(text)["input_ids"]
        if want != got:
            at = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
            raise RuntimeError(f"GGUF check failed: the GGUF tokenizer gives other ids for a chat prompt "
                               f"(first difference at token {at}: {want[at:at + 3]} vs {got[at:at + 3]})")
        probes.append(torch.tensor([want]))
    expected = _logits(AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32), probes)

    # transformers' own reader (and its inverse permutation / norm offset), called once for config
    # and tensors: from_pretrained(gguf_file=...) would parse the metadata again for each.
    model = AutoModelForCausalLM.from_config(_as_gguf_arch(reference_config), dtype=torch.float32)
    with _memoized_name_maps():
        parsed = load_gguf_checkpoint(str(folder / file), return_tensors=True, model_to_load=model)
    _check_config(parsed["config"], reference_config)
    tensors = parsed["tensors"]
    _check_tensors(tensors, reference_dir, reference_config, gguf_type=gguf_type)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    del parsed, tensors
    tied = {"lm_head.weight"} if reference_config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF check failed: transformers reads back missing {sorted(missing)[:3]}, "
                           f"unexpected {sorted(unexpected)[:3]}")
    got = _logits(model, probes)
    diff = max(float((g - e).abs().max()) for g, e in zip(got, expected, strict=True))
    scale = max(1.0, max(float(e.abs().max()) for e in expected))
    bound = GGUF_BOUNDS[gguf_type] * scale if gguf_type in GGUF_BOUNDS else None
    if bound is not None and not diff <= bound:
        raise RuntimeError(f"GGUF check failed: {gguf_type} logits differ from the model's by {diff:.3g} > {bound:.3g}")
    return GgufCheck(max_abs_diff=diff, bound=bound)


def _check_config(parsed: dict, reference) -> None:
    """The hyperparameters as transformers reads them from the metadata."""
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        want, got = getattr(reference, key), parsed.get(key)
        if want != got:
            raise RuntimeError(f"GGUF check failed: {key} reads back as {got}, the model has {want}")
    if not math.isclose(parsed.get("rms_norm_eps", 0.0), reference.rms_norm_eps, rel_tol=1e-6):
        raise RuntimeError(f"GGUF check failed: rms_norm_eps reads back as {parsed.get('rms_norm_eps')}")


def _check_tensors(tensors: dict, reference_dir: Path, config, *, gguf_type: str) -> None:
    """Every tensor transformers reads back must equal, bit for bit, the reference tensor rounded
    the way we meant to store it (quantize then dequantize with gguf-py, in HF layout: rounding is
    per row block, so it commutes with llama.cpp's row permutation). This proves the layout, the
    names and the types for every GGUF type, where the logits bound alone is loose for 4-bit."""
    import gguf
    import torch
    from safetensors import safe_open

    family = FAMILIES[config.model_type]
    arch = gguf.MODEL_ARCH[family.arch]
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for file in sorted(Path(reference_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name not in tensors:
                    continue  # a tied head, or rotary buffers: the load_state_dict check covers them
                reference = f.get_tensor(name).to(torch.float32).numpy()
                kind, _ = name_map.get_type_and_name(name, try_suffixes=(".weight", ".bias"))
                qtype = tensor_qtype(kind, reference.shape, gguf_type)
                stored = reference + np.float32(1.0) if family.norm_plus_one and name.endswith("norm.weight") else reference
                want = _round_trip(stored, qtype)
                if stored is not reference:
                    want = want - np.float32(1.0)
                got = tensors[name].numpy()
                if got.shape != want.shape or not np.array_equal(got, want):
                    raise RuntimeError(f"GGUF check failed: {name} reads back different from what was meant to be written")


def _round_trip(array: np.ndarray, qtype) -> np.ndarray:
    import gguf

    Q = gguf.GGMLQuantizationType
    if qtype == Q.F32:
        return array
    if qtype == Q.F16:
        return array.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)


class _memoized_name_maps:
    """transformers builds gguf's TensorNameMap once per module of the model (397 times for
    SmolLM2: 23 of the 55 s its GGUF loader took); the map depends on (arch, layers) only."""

    def __enter__(self):
        import functools

        import gguf

        self.original = gguf.get_tensor_name_map
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(self.original)

    def __exit__(self, *exc):
        import gguf

        gguf.get_tensor_name_map = self.original


def _as_gguf_arch(config):
    """Mistral as llama.cpp runs it: the Llama graph (transformers 5.24 cannot map a `mistral`
    model onto gguf-py's names). The probes are far shorter than any sliding window."""
    if config.model_type != "mistral":
        return config
    from transformers import LlamaConfig

    values = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "sliding_window", "architectures")}
    return LlamaConfig(**values, architectures=["LlamaForCausalLM"])


def _logits(model, probes) -> list:
    import torch

    model.eval()
    with torch.no_grad():
        out = [model(input_ids=ids).logits.float() for ids in probes]
    del model
    return out


def load_gguf(path: Path):
    """(model in fp32, tokenizer) from a GGUF file through transformers' GGUF loader, as a user
    of `from_pretrained(folder, gguf_file=...)` gets them."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="gguf-load-") as alone:
        (Path(alone) / path.name).symlink_to(path.resolve())  # see verify_gguf: alone in its folder
        tokenizer = AutoTokenizer.from_pretrained(alone, gguf_file=path.name)
        with _memoized_name_maps():
            model = AutoModelForCausalLM.from_pretrained(alone, gguf_file=path.name, dtype=torch.float32)
    return model, tokenizer
