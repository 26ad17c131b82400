"""A written GGUF read back with llama.cpp's own Python reader (gguf-py's GGUFReader), for every
architecture homelab-ft writes, whether or not transformers' GGUF loader knows it.

`read_back` checks what the file says against the merged model it was written from: the
architecture and hyperparameter keys llama.cpp reads, that every tensor of the checkpoint has its
GGUF tensor and no other is there, and that each holds, bit for bit, the checkpoint's values in
llama.cpp's layout rounded as its type rounds them. `load_model` turns the tensors back into
Hugging Face's layout and loads them through transformers' own `from_pretrained` (so MoE experts,
stacked in the GGUF, are split by transformers' checkpoint conversion, not by us), which is how
gguf_check compares logits when transformers' GGUF loader does not read the architecture.
`metadata_twin` copies the tokenizer metadata into a file transformers reads, for the same case.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from homelab_ft.export.gguf.arch import Target
from homelab_ft.export.gguf.export import plan_tensors
from homelab_ft.export.gguf.hparams import ff_lengths, kv_heads, norm_eps
from homelab_ft.locate import gguf_reader


def stored(tensor) -> np.ndarray:
    """A GGUF tensor dequantized to float32, in numpy's (outermost first) order."""
    import gguf

    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)


def round_trip(array: np.ndarray, qtype) -> np.ndarray:
    """`array` as a GGUF tensor of `qtype` reads back (quantized, then dequantized by gguf-py)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if qtype == Q.F32:
        return array
    if qtype == Q.F16:
        return array.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)


def read_back(gguf_path: Path, reference_dir: Path, *, target: Target, gguf_type: str) -> None:
    """Prove `gguf_path` holds the reference rounded as meant, one tensor at a time (host memory
    stays near the largest tensor); raises RuntimeError on any difference in the keys or tensors."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(reference_dir)
    reader = gguf_reader(gguf_path)
    _check_keys(reader.fields, config, target=target)
    tensors = {t.name: t for t in reader.tensors}
    plan = plan_tensors(reference_dir, config, target=target, gguf_type=gguf_type)
    missing = sorted({item.gguf_name for item in plan} - set(tensors))
    extra = sorted(set(tensors) - {item.gguf_name for item in plan})
    if missing or extra:
        raise RuntimeError(f"GGUF check failed: tensors missing {missing[:3]}, not from the model {extra[:3]}")
    for item in plan:
        tensor = tensors[item.gguf_name]
        if tensor.tensor_type != item.qtype:
            raise RuntimeError(f"GGUF check failed: {item.gguf_name} is {tensor.tensor_type.name}, meant {item.qtype.name}")
        got, want = stored(tensor), round_trip(item.load(), item.qtype)
        if got.shape != want.shape or not np.array_equal(got, want):
            raise RuntimeError(f"GGUF check failed: {item.gguf_name} reads back different from what was meant to be written")


def _check_keys(fields: dict, config, *, target: Target) -> None:
    arch = str(fields["general.architecture"].contents())
    if arch != target.arch_name:
        raise RuntimeError(f"GGUF check failed: general.architecture is {arch!r}, meant {target.arch_name!r}")
    want = {"block_count": config.num_hidden_layers, "embedding_length": config.hidden_size,
            "feed_forward_length": ff_lengths(config), "attention.head_count": config.num_attention_heads,
            "attention.head_count_kv": kv_heads(config, target=target),
            "context_length": config.max_position_embeddings, "vocab_size": config.vocab_size}
    for key, value in want.items():  # as gguf_hparams writes them: one value, or one per layer
        field = fields.get(f"{arch}.{key}")
        got = field.contents() if field is not None else None
        if got != value:
            raise RuntimeError(f"GGUF check failed: {arch}.{key} reads back as {got}, written from the model as {value}")
    eps = fields.get(f"{arch}.attention.layer_norm_rms_epsilon")
    if eps is None or not math.isclose(eps.contents(), norm_eps(config), rel_tol=1e-6):
        raise RuntimeError(f"GGUF check failed: {arch}.attention.layer_norm_rms_epsilon differs from rms_norm_eps")
    check_fields(fields, written_keys(getattr(config, "gguf_keys", None) or {}, arch))


def written_keys(methods: dict[str, object], arch: str) -> dict[str, object]:
    """The key -> value GGUFWriter's `methods` (method name -> argument) put in a file of `arch`,
    from a writer that writes nothing."""
    import gguf

    writer = gguf.GGUFWriter(None, arch)
    for method, value in methods.items():
        getattr(writer, method)(value)
    return {key: value.value for key, value in writer.kv_data[0].items()}


def check_fields(fields: dict, want: dict[str, object]) -> None:
    """RuntimeError naming the first key of `want` the file's fields (GGUFReader.fields) do not hold
    as written (floats within 1e-6, relative)."""
    for key, value in want.items():
        got = fields[key].contents() if key in fields else None
        same = (got is not None and len(got) == len(value) and all(
            math.isclose(a, b, rel_tol=1e-6) for a, b in zip(got, value, strict=True))
                if isinstance(value, list) else
                got is not None and math.isclose(got, value, rel_tol=1e-6) if isinstance(value, float) else got == value)
        if not same:
            raise RuntimeError(f"GGUF check failed: {key} reads back as {got}, meant {value}")


def load_model(gguf_path: Path, reference_dir: Path, *, target: Target, gguf_type: str):
    """The GGUF's weights in Hugging Face's layout, loaded in fp32 with the reference's config
    through `from_pretrained` (which splits the experts back by transformers' own conversion)."""
    import json
    import tempfile

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(reference_dir)
    tensors = {t.name: t for t in gguf_reader(gguf_path).tensors}
    state, pieces = {}, {}
    for item in plan_tensors(reference_dir, config, target=target, gguf_type=gguf_type):
        if item.extra is not None:
            continue  # rope_freqs: computed from the config, not a weight
        array = target.from_gguf(item.gguf_name, stored(tensors[item.gguf_name]).reshape(item.hf_shape), config)
        if item.reshaped is not None:  # the parts of one checkpoint tensor come in order: joined by its rule
            got = pieces.setdefault(item.sources, [])
            got.append(array)
            if len(got) < len(item.reshaped.parts):
                continue
            array = item.reshaped.join(pieces.pop(item.sources), config)
        parts = [array] if len(item.sources) == 1 else list(array)
        for (_, hf_name), part in zip(item.sources, parts, strict=True):
            state[hf_name] = torch.from_numpy(np.array(part, dtype=np.float32, order="C"))  # a copy: the reader maps the file read-only
    with tempfile.TemporaryDirectory(prefix="gguf-readback-") as folder:
        save_file(state, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})
        (Path(folder) / "config.json").write_text(json.dumps(json.loads((Path(reference_dir) / "config.json").read_text())))
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def metadata_twin(gguf_path: Path, out_path: Path, *, tokenizer: bool) -> Path:
    """A GGUF of `gguf_path`'s metadata alone (no tensors): with `tokenizer`, its tokenizer keys
    under an architecture transformers' GGUF loader reads (llama), whose tokenizer is built from
    those keys whatever the model; without, every other key under the file's own architecture,
    which that loader parses in milliseconds instead of a token list's seconds."""
    import gguf

    reader = gguf_reader(gguf_path)
    arch = "llama" if tokenizer else str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(out_path, arch)
    try:
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture" or name.startswith("tokenizer.") != tokenizer:
                continue
            main = field.types[0]
            sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), main, sub_type=sub)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return out_path
