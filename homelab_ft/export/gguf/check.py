"""Read a written GGUF back and compare it with its source: with gguf-py's reader for every
architecture (gguf_readback.py), and through transformers' GGUF loader where it reads it.

transformers' reader (`modeling_gguf_pytorch_utils.load_gguf_checkpoint`, behind
`from_pretrained(..., gguf_file=...)`) is an implementation independent of our writer: it undoes
llama.cpp's q/k permutation and Gemma's norm offset with its own code, and builds the tokenizer
from the metadata with its own code. What it reads back is compared with the model the GGUF was
written from: hyperparameters, tokenizer ids and chat template, every tensor bit for bit (against
the source rounded as meant), and the logits.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from homelab_ft.export.gguf import arch as gguf_arch
from homelab_ft.export.gguf import readback as gguf_readback
from homelab_ft.export.gguf.export import plan_tensors
from homelab_ft.locate import gguf_reader

log = logging.getLogger(__name__)

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
    """Read the GGUF back and compare it with `reference_dir` (the merged model it was written from).

    Always, with gguf-py's reader (gguf_readback.read_back): the architecture and hyperparameter
    keys, every tensor present and bit for bit what was meant. Then, where transformers' GGUF
    loader reads the architecture, through that independent reader (it undoes llama.cpp's q/k
    permutation and Gemma's norm offset with its own code, and builds the tokenizer from the
    metadata): the hyperparameters it reads, the tokenizer (same ids on chat-formatted prompts,
    same chat template and end-of-sequence token) and the logits on those prompts within
    GGUF_BOUNDS[gguf_type]. Where it does not (SmolLM3, OLMo 2/3, Gemma 1), the tokenizer is
    checked the same way from a copy of the tokenizer keys, and the logits of the tensors read back
    (gguf_readback.load_model). The weights are loaded into the reference's config: transformers' GGUF reader does not read rope
    scaling or Qwen3's head size, which llama.cpp does read from the keys written. Raises
    RuntimeError on a mismatch.
    """
    import tempfile

    reference_dir = Path(reference_dir)
    target = gguf_arch.check_architecture(reference_dir)
    gguf_readback.read_back(gguf_path, reference_dir, target=target, gguf_type=gguf_type)
    reads = transformers_reads(gguf_path)
    with tempfile.TemporaryDirectory(prefix="gguf-check-") as alone:
        # Alone in its folder: beside tokenizer.json / tokenizer_config.json (a safetensors,gguf
        # export) transformers 5.24 builds the tokenizer from those files and not from the GGUF.
        folder, file = Path(alone), Path(gguf_path).name
        (folder / file).symlink_to(Path(gguf_path).resolve())
        if not reads:
            file = gguf_readback.metadata_twin(gguf_path, folder / "tokenizer-only.gguf", tokenizer=True).name
        probes = _check_tokenizer(folder, file, reference_dir)
    model = (_transformers_model(gguf_path, reference_dir, gguf_type=gguf_type, check=True) if reads
             else _newer_loader_model(gguf_path, reference_dir))
    if model is None:
        model = gguf_readback.load_model(gguf_path, reference_dir, target=target, gguf_type=gguf_type)
    return _compare_logits(model, reference_dir, probes, gguf_type=gguf_type)


def reader_diffs(gguf_path: Path, reference_dir: Path, *, gguf_type: str) -> dict[str, float | None]:
    """Max |logit difference| from the reference on the check's prompts, for each reader of the
    file, both loaded into the reference's config: gguf-py's (every architecture) and transformers'
    GGUF loader (None where it does not read the file or cannot map its names). verify_gguf
    compares one; this is the family table of issue 38 (bench/gguf_families.py, tests/e2e)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference_dir = Path(reference_dir)
    tokenizer = AutoTokenizer.from_pretrained(reference_dir)
    probes = [torch.tensor([tokenizer(text)["input_ids"]]) for text in probe_texts(tokenizer)]
    expected = _logits(AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32), probes)
    target = gguf_arch.check_architecture(reference_dir)
    readers = {"gguf-py": gguf_readback.load_model(gguf_path, reference_dir, target=target, gguf_type=gguf_type),
               "transformers": _transformers_model(gguf_path, reference_dir, gguf_type=gguf_type, check=False)
               if transformers_reads(gguf_path) else _newer_loader_model(gguf_path, reference_dir)}
    return {name: None if model is None else max(float((g - e).abs().max())
                                                 for g, e in zip(_logits(model, probes), expected, strict=True))
            for name, model in readers.items()}


def load_gguf_model(path: Path, reference_dir: Path, *, gguf_type: str):
    """The GGUF's model in fp32, loaded as verify_gguf loads it: into the reference's own config
    (as llama.cpp runs it, `_as_gguf_arch`), through transformers' GGUF loader where it reads the
    architecture and this model's names, else from gguf-py's reading of the tensors. Never from a
    config rebuilt out of the GGUF's metadata: transformers 5.24 reads that incompletely (no
    expert sizes, head_dim or query_pre_attn_scalar; Mixtral as a dense Llama), which ran another
    model than the file holds (issue 38)."""
    reference_dir = Path(reference_dir)
    model = (_transformers_model(path, reference_dir, gguf_type=gguf_type, check=False) if transformers_reads(path)
             else _newer_loader_model(path, reference_dir))
    if model is None:
        target = gguf_arch.check_architecture(reference_dir)
        model = gguf_readback.load_model(path, reference_dir, target=target, gguf_type=gguf_type)
    return model


def transformers_reads(gguf_path: Path) -> bool:
    """Whether transformers' GGUF loader reads this file's architecture (it raises otherwise),
    asked of a copy of the metadata without the token list, which it would parse in Python.

    A loader that knows the architecture but fails on its keys counts as not reading it, said in
    one line: transformers 5.25 reads gpt-oss's `rope.scaling.*` values from the wrong part of
    gguf-py's field (`parts[0]`, the key's length) and raises TypeError on every gpt-oss GGUF with
    YaRN, llama.cpp's own included; its Gemma 4 config takes no per-layer `head_count_kv` (26B-A4B's
    num_global_key_value_heads). gguf-py's reading (gguf_readback) checks the file then."""
    import tempfile

    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with tempfile.TemporaryDirectory(prefix="gguf-arch-") as folder:
        twin = gguf_readback.metadata_twin(gguf_path, Path(folder) / "metadata.gguf", tokenizer=False)
        try:
            load_gguf_checkpoint(str(twin), return_tensors=False)
            AutoConfig.from_pretrained(folder, gguf_file=twin.name)  # the config class it builds from the keys
        except ValueError as err:
            if "not supported" in str(err):
                return False
            raise
        except (TypeError, KeyError, StrictDataclassError) as err:
            log.info("transformers' GGUF loader fails on %s's metadata (%s: %s); reading it with gguf-py", gguf_path,
                     type(err).__name__, err)
            return False
    return True


def check_window(model_dir: Path, *, target: gguf_arch.Target) -> None:
    """A sliding window llama.cpp's graph does not apply (Mistral as `llama`) is written with a
    warning (gguf_hparams) when the check's prompts fit in it, as Mistral 7B v0.1's 4096 tokens
    do: the file then differs from the model only past the window. A shorter window runs another
    model on the check's own prompts (and on most chats): GgufUnsupported, asked before anything
    is written (export.run), not left to fail verify_gguf with a traceback."""
    from transformers import AutoConfig

    window = getattr(AutoConfig.from_pretrained(model_dir), "sliding_window", None)
    if not window or target.layout.sliding_window:
        return
    longest = max(probe_lengths(model_dir))
    if window < longest:
        raise gguf_arch.GgufUnsupported(
            f"{model_dir}/config.json: sliding_window = {window} is shorter than the export check's prompts "
            f"({longest} tokens): llama.cpp runs {target.model_type} as {target.arch_name!r}, with no sliding window, "
            f"so past {window} tokens it would run another model")


def probe_lengths(model_dir: Path) -> list[int]:
    """Tokens of each PROBE_CHATS prompt in `model_dir`'s tokenizer: what verify_gguf compares the
    logits on."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [len(tokenizer(text)["input_ids"]) for text in probe_texts(tokenizer)]


def probe_texts(tokenizer) -> list[str]:
    """PROBE_CHATS rendered by the model's chat template: the prompts the check compares the logits
    on (and llama.cpp's run of the file, tests/llama_text.py)."""
    return [_probe_text(tokenizer, chat) for chat in PROBE_CHATS]


def _probe_text(tokenizer, chat: list[dict]) -> str:
    """A probe chat rendered by the model's template; with content parts (`{"type": "text"}`) where
    the template reads those, as image-text models' do (SmolVLM's renders a plain string as no text)."""
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    if all(message["content"] in text for message in chat):
        return text
    typed = [{**message, "content": [{"type": "text", "text": message["content"]}]} for message in chat]
    return tokenizer.apply_chat_template(typed, tokenize=False, add_generation_prompt=True)


def _check_tokenizer(folder: Path, file: str, reference_dir: Path) -> list:
    """The prompts' ids as tensors, once the GGUF's tokenizer gives the reference's ids and template."""
    import torch
    from transformers import AutoTokenizer

    reference_tok = AutoTokenizer.from_pretrained(reference_dir)
    gguf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    if reference_tok.chat_template != gguf_tok.chat_template:
        raise RuntimeError("GGUF check failed: the chat template in the GGUF differs from the tokenizer's")
    if reference_tok.eos_token_id != gguf_tok.eos_token_id:  # the token a reply stops at (llama.cpp, Ollama)
        raise RuntimeError(f"GGUF check failed: the GGUF's end-of-sequence token is {gguf_tok.eos_token!r}, the "
                           f"tokenizer's {reference_tok.eos_token!r}")
    probes = []
    for text in probe_texts(reference_tok):
        want, got = reference_tok(text)["input_ids"], gguf_tok(text)["input_ids"]
        if want != got:
            at = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
            raise RuntimeError(f"GGUF check failed: the GGUF tokenizer gives other ids for a chat prompt "
                               f"(first difference at token {at}: {want[at:at + 3]} vs {got[at:at + 3]})")
        probes.append(torch.tensor([want]))
    return probes


def _newer_loader_model(path: Path, reference_dir: Path):
    """The GGUF through transformers 5.25's newer GGUF loader (integrations/gguf, behind
    `from_pretrained(gguf_file=...)` for Qwen 3.5 dense and MoE and LFM2), which undoes llama.cpp's
    layout with its own code (norm offsets, A = -exp(A_log), Qwen 3.5's tiled value heads), loaded
    into the reference's config; None for an architecture it does not handle (the legacy loader's
    `transformers_reads`, or gguf-py's reading then)."""
    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.gguf import is_gguf_arch_supported

    arch = str(gguf_reader(path).fields["general.architecture"].contents())
    if not is_gguf_arch_supported(arch):
        return None
    with tempfile.TemporaryDirectory(prefix="gguf-load-") as alone:
        (Path(alone) / "model.gguf").symlink_to(Path(path).resolve())  # alone: see verify_gguf
        return AutoModelForCausalLM.from_pretrained(alone, gguf_file="model.gguf", dtype=torch.float32,
                                                    config=AutoConfig.from_pretrained(reference_dir))


def _transformers_model(path: Path, reference_dir: Path, *, gguf_type: str, check: bool):
    """The tensors as transformers' own GGUF reader returns them (its inverse permutation and norm
    offset), loaded into the reference's config; with `check`, the hyperparameters it reads and
    every tensor it returns compared with what was meant first. None where it reads the
    architecture but cannot map this model's names onto it (Mixtral as llama)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    reference_config = AutoConfig.from_pretrained(reference_dir)
    model = AutoModelForCausalLM.from_config(_as_gguf_arch(reference_config), dtype=torch.float32)
    try:
        # called once for config and tensors: from_pretrained(gguf_file=...) parses the metadata again for each
        with _memoized_name_maps():
            parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    except NotImplementedError as err:
        log.info("transformers' GGUF loader cannot map %s onto the model (%s); reading it with gguf-py", path, err)
        return None
    tensors = parsed.pop("tensors")
    if check:
        _check_config(parsed["config"], reference_config)
        _check_tensors(tensors, reference_dir, reference_config, gguf_type=gguf_type)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    del parsed, tensors
    buffers = {name for name, _ in model.named_buffers()} & set(missing)
    if buffers:  # Gemma 4's layer_scalar: gguf_readback read it; transformers 5.25's reader maps none
        log.info("transformers' GGUF loader does not read %s's %s; reading it with gguf-py", path, sorted(buffers)[0])
        return None
    tied = {"lm_head.weight"} if reference_config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF check failed: transformers reads back missing {sorted(missing)[:3]}, "
                           f"unexpected {sorted(unexpected)[:3]}")
    if reference_config.tie_word_embeddings:
        model.tie_weights()
    return model


def _compare_logits(model, reference_dir: Path, probes: list, *, gguf_type: str) -> GgufCheck:
    import torch
    from transformers import AutoModelForCausalLM

    got = _logits(model, probes)
    expected = _logits(AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32), probes)
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
    the way we meant to store it, taken back to Hugging Face's layout with our inverse (rounding is
    per row block, so it commutes with llama.cpp's row permutation). transformers' reader undoes
    the layout with its own code, so a layout it does not expect shows here; experts, which it
    returns fused under other names, are left to the logits and to gguf_readback's bit check."""
    target = gguf_arch.check_architecture(reference_dir)
    for item in plan_tensors(reference_dir, config, target=target, gguf_type=gguf_type):
        split = item.reshaped is not None and len(item.reshaped.parts) > 1
        if len(item.sources) != 1 or item.sources[0][1] not in tensors or split:
            continue  # a tied head, rotary buffers, experts or one of several parts: load_state_dict covers them
        name = item.sources[0][1]
        rounded = gguf_readback.round_trip(item.load(), item.qtype).reshape(item.hf_shape)
        want = target.from_gguf(item.gguf_name, rounded, config)
        if item.reshaped is not None:
            want = item.reshaped.join([want], config)
        got = tensors[name].numpy()
        if got.shape != want.shape or not np.array_equal(got, want):
            raise RuntimeError(f"GGUF check failed: {name} reads back different from what was meant to be written")


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
    model onto gguf-py's names), with no sliding window; a window shorter than the probes is
    refused before anything is written (check_window)."""
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
