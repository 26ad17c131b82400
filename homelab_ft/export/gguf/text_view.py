"""The language model of an image-text checkpoint as a causal-LM folder, so the text GGUF is written
and checked by the same code as any text model.

llama.cpp runs an image-text model as two files: the language model, a GGUF of its text family
(SmolVLM's is `llama`, Gemma 3's `gemma3`, InternVL 3's `qwen2`), and the vision tower with its
projector in a separate `mmproj` GGUF (mmproj.py). convert_hf_to_gguf.py writes the first by merging
`text_config` into the hyperparameters and stripping the language model's prefix from its tensor
names. Here the same is derived from transformers, never from a list of prefixes: the image-text
model is built on the meta device, its language model is `get_decoder()` and its head
`get_output_embeddings()`; the causal LM of `config.get_text_config()` is built beside it, and every
language-model tensor is read through transformers' own key conversion (model/checkpoint_keys.py)
and saved under the causal LM's name. The folder written (config.json of the text config,
generation_config.json, the tokenizer files, the weights) is what `write_gguf`, `verify_gguf` and
RUNNING.md's notes read: the text GGUF is checked against the language model with the logits of
transformers' own causal LM.

Where transformers has no causal LM for the text config (Qwen2-VL, Qwen2.5-VL and Qwen3-VL, whose
decoders run M-RoPE), the folder is the causal LM of its twin (CAUSAL_TWINS): the family whose
decoder is the same tensor for tensor and computes the same logits on text. It then also names the
architecture llama.cpp runs the language model as (`gguf_architecture`, which arch.py reads instead
of the model type) and the keys that architecture reads beyond the twin's (`gguf_keys`, GGUFWriter
method -> value: the M-RoPE sections, Qwen3-VL's deepstack layer count), as llama.cpp's converter
writes them from the image-text config.

It costs the language model's weights once more on disk while the export runs (the folder is a
scratch folder inside the export's staging folder, dropped when the GGUF is checked), read and
written one tensor at a time, saved in shards of at most SHARD_BYTES.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from homelab_ft.errors import UserError
from homelab_ft.export.gguf.arch import GgufUnsupported

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt")
"""The tokenizer's files, copied as they are (the text GGUF's vocabulary and chat template come from them)."""

SHARD_BYTES = 2 * 2**30
"""Weights per saved shard: host memory holds one shard while it is written."""


CAUSAL_TWINS = {
    "qwen2_vl_text": ("qwen2", "qwen2vl"),
    "qwen2_5_vl_text": ("qwen2", "qwen2vl"),
    "qwen3_vl_text": ("qwen3", "qwen3vl"),
}
"""Text model types transformers builds no causal LM for -> (the model type of the causal LM that
computes their language model on text, the llama.cpp architecture it is written as). Qwen2-VL and
Qwen2.5-VL decode with Qwen2's layers, Qwen3-VL with Qwen3's, under M-RoPE: rotary frequencies split
into time, height and width sections, each turned by its own position id; on text all three ids are
the token's position, so M-RoPE is the twin's 1-D rope (tests/unit/export/gguf/test_gguf_mmproj.py:
the twin's logits equal the image-text model's). llama.cpp's converter registers the first two under
Qwen2VLModel (`qwen2vl`), Qwen3-VL under Qwen3VLTextModel (`qwen3vl`), a choice neither transformers
nor gguf-py records."""


def image_text_config(model_dir: Path):
    """`model_dir`'s config when transformers builds it as an image-text model with a separate text
    config (AutoModelForImageTextToText's mapping), else None."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    if getattr(config, "auto_map", None) or type(config) not in AutoModelForImageTextToText._model_mapping:
        return None
    return config if config.get_text_config() is not config else None


def text_names(config) -> dict[str, str]:
    """Each tensor of the image-text model's language model and head (transformers' names) -> its
    name in the causal LM of `config.get_text_config()`; GgufUnsupported where transformers has no causal
    LM for the text config or the two do not line up tensor for tensor."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    text_config = causal_config(config)
    with torch.device("meta"):
        image_text = AutoModelForImageTextToText.from_config(config)
        try:
            causal = AutoModelForCausalLM.from_config(text_config)
        except ValueError as err:
            raise GgufUnsupported(f"{config.model_type}: transformers has no causal LM for its text config "
                            f"{text_config.model_type!r}, so its language model cannot be written as a text GGUF "
                            "by homelab-ft") from err
    source, target = _parts(image_text), _parts(causal)
    names = {}
    for part in ("decoder", "head"):
        (src_prefix, src_module), dst_prefix = source[part], target[part][0]
        for name, _ in src_module.named_parameters():
            names[f"{src_prefix}.{name}"] = f"{dst_prefix}.{name}"
    wanted = {name for name, _ in causal.named_parameters(remove_duplicate=False)}
    if set(names.values()) != wanted:
        raise GgufUnsupported(f"{config.model_type}: its language model's tensors do not line up with "
                        f"{type(causal).__name__}'s ({sorted(wanted ^ set(names.values()))[:3]}), so homelab-ft "
                        "cannot write it as a text GGUF")
    return names


def causal_config(config):
    """The config of the causal LM the language model of the image-text `config` is laid out as:
    its text config, or for a text model type in CAUSAL_TWINS its twin's config with the same values
    (the M-RoPE keys left out: written as gguf_keys)."""
    from transformers import CONFIG_MAPPING

    text = config.get_text_config()
    if text.model_type not in CAUSAL_TWINS:
        return text
    values = {k: v for k, v in text.to_dict().items() if k not in ("model_type", "architectures", "transformers_version")}
    values["rope_parameters"] = {k: v for k, v in (text.rope_parameters or {}).items() if not k.startswith("mrope")}
    return CONFIG_MAPPING[CAUSAL_TWINS[text.model_type][0]](**values)


def llama_cpp_keys(config) -> dict[str, object]:
    """For a language model written through its twin: `gguf_architecture` and `gguf_keys`, the
    keys llama.cpp's converter writes for it beyond the twin's (TextModel's `rope.dimension_sections`
    from mrope_section, padded to 4; Qwen3VLTextModel's `n_deepstack_layers`, one per deepstack
    merger of the vision tower); {} for any other."""
    text = config.get_text_config()
    if text.model_type not in CAUSAL_TWINS:
        return {}
    keys = {}
    sections = list((text.rope_parameters or {}).get("mrope_section") or [])
    if sections:
        keys["add_rope_dimension_sections"] = [*sections, *[0] * (4 - len(sections))]
    deepstack = getattr(config.vision_config, "deepstack_visual_indexes", None)
    if deepstack is not None:
        keys["add_num_deepstack_layers"] = len(deepstack)
    return {"gguf_architecture": CAUSAL_TWINS[text.model_type][1], "gguf_keys": keys}


def _parts(model) -> dict[str, tuple[str, object]]:
    """Dotted name and module of the decoder and the output head of `model`."""
    modules = {id(module): name for name, module in model.named_modules()}
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    return {"decoder": (modules[id(decoder)], decoder), "head": (modules[id(head)], head)}


def write_text_view(model_dir: Path, out_dir: Path) -> Path:
    """Write the language model of the image-text checkpoint `model_dir` into `out_dir` as a causal
    LM folder (module docstring); returns `out_dir`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText

    from homelab_ft.model.checkpoint_keys import CheckpointKeys

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = image_text_config(model_dir)
    if config is None:
        raise UserError(f"{model_dir}/config.json is not an image-text model's config")
    names = text_names(config)
    with torch.device("meta"):
        image_text = AutoModelForImageTextToText.from_config(config)
    keys = CheckpointKeys(image_text, model_dir)
    tied = _tied(image_text)
    wanted = [name for name, text_name in names.items() if not (tied and text_name == "lm_head.weight")]
    converted = [name for name in wanted if name in keys.names() and keys.converted(name)]
    if converted:
        raise GgufUnsupported(f"{model_dir}: {converted[0]} is converted by transformers on load (stacked experts), which "
                        "the text GGUF of an image-text checkpoint does not write yet")
    out_dir.mkdir(parents=True, exist_ok=True)
    shards, shard, size = [], {}, 0
    for name, tensor in keys.tensors(wanted):
        shard[names[name]] = tensor.contiguous()
        size += tensor.numel() * tensor.element_size()
        if size >= SHARD_BYTES:
            shards.append(shard)
            shard, size = {}, 0
    shards.append(shard)
    _save_shards(shards, out_dir, save_file)
    write_text_config(config, model_dir, out_dir, tied=tied)
    log.info("the language model of %s (%s, %d tensors) laid out as a %s folder for its text GGUF", model_dir,
             config.model_type, sum(len(s) for s in shards), causal_config(config).model_type)
    return out_dir


def _save_shards(shards: list[dict], out_dir: Path, save_file) -> None:
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _tied(image_text) -> bool:
    """Whether the head is the input embedding as the image-text model ties them (InternVL ties at
    the top level of its config, where its Qwen2 text config says untied)."""
    return image_text.get_output_embeddings().weight is image_text.get_input_embeddings().weight


def language_model(model_dir: Path):
    """(gguf_arch.Target, config, names) of the language model of `model_dir` as its text GGUF is
    written: for an image-text checkpoint, the target and config of its text view and `text_names`
    (the image-text model's tensor names -> the causal LM's); for a text model, its own and None.
    Reads config.json and the tokenizer files only."""
    import tempfile

    from transformers import AutoConfig

    from homelab_ft.export.gguf.arch import check_architecture

    config = image_text_config(model_dir)
    if config is None:
        return check_architecture(model_dir), AutoConfig.from_pretrained(model_dir), None
    with tempfile.TemporaryDirectory(prefix="gguf-text-config-") as folder:
        write_text_config(config, Path(model_dir), Path(folder))
        target, causal = check_architecture(Path(folder)), AutoConfig.from_pretrained(folder)
    return target, causal, text_names(config)


def write_text_config(config, model_dir: Path, out_dir: Path, *, tied: bool | None = None) -> None:
    """The text config as a causal LM's config.json (its architecture named as the causal-LM
    mapping names it), the generation config, and the tokenizer's files: the text view less its
    weights, which is all the GGUF writer's architecture checks read."""
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if tied is None:
        with torch.device("meta"):
            tied = _tied(AutoModelForImageTextToText.from_config(config))
    out_dir.mkdir(parents=True, exist_ok=True)

    text = causal_config(config)
    values = text.to_dict()
    values["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[text.model_type]]
    values["tie_word_embeddings"] = tied
    values.update(llama_cpp_keys(config))
    (out_dir / "config.json").write_text(json.dumps(values, indent=1))
    for name in ("generation_config.json", *TOKENIZER_FILES):
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out_dir / name)
