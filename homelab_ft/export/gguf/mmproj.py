"""The vision tower and projector of an image-text checkpoint as llama.cpp's `mmproj` GGUF.

llama.cpp's multimodal library (tools/mtmd, clip.cpp) loads a second GGUF beside the language
model's: architecture `clip`, `general.type` `mmproj`, the `clip.vision.*` hyperparameters and the
`v.*` / `mm.*` tensors of gguf-py's MODEL_ARCH.MMPROJ, plus `clip.projector_type`, which picks the
graph clip.cpp builds. This module writes that file as convert_hf_to_gguf.py does with `--mmproj`
(its MmprojModel and the subclass registered for the image-text class), with gguf-py's writer and
tensor name map, one tensor at a time.

Which tensors are the vision side is derived: every tensor of the image-text model (built on the
meta device, read through transformers' key conversion, model/checkpoint_keys.py) outside its
language model and head. Each is named by gguf-py's map from transformers' own parameter name
(less the base model's `model.` prefix), after the renames its converter makes; a tensor the map
has no place for refuses the family before anything is written. What cannot be derived is
llama.cpp's graph: mmproj_families.PROJECTORS holds, per image-text class llama.cpp's converter
registers, the projector type, the converter's renames, splits and value transforms, the tensors
it keeps in f32/f16, the family's extra keys and the settings llama.cpp fixes. A family outside
PROJECTORS is refused in one line (the safetensors export is unaffected): its conversion has not
been read here, or llama.cpp has no graph for it.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from homelab_ft.errors import UserError
from homelab_ft.export.gguf.arch import GgufUnsupported, permute_heads, unpermute_heads
from homelab_ft.export.gguf.export import encode, tensor_qtype
from homelab_ft.export.gguf.mmproj_families import NO_GRAPH, PROJECTORS, Projector

log = logging.getLogger(__name__)

MMPROJ_FILE = "mmproj-{gguf_type}.gguf"


def mmproj_type(gguf_type: str) -> str:
    """The mmproj's type for a text GGUF of `gguf_type`: the same down to q8_0, f16 below it. The
    vision tower is small (SigLIP-400M is 0.8 GB in f16) and llama.cpp's own releases of these models
    (ggml-org's SmolVLM, Gemma 3 and InternVL 3 GGUFs) ship the mmproj in f16 or q8_0 beside any text
    quantization; 4-bit vision weights are not offered there."""
    return gguf_type if gguf_type in ("f32", "f16", "bf16", "q8_0") else "f16"


@dataclass(frozen=True)
class MmprojTensor:
    gguf_name: str
    checkpoint_name: str
    """transformers' parameter name (what CheckpointKeys reads)."""
    shape: tuple[int, ...]
    """In the GGUF, numpy order: the checkpoint's (or its slice's) less its unit dimensions (the converter's squeeze)."""
    hf_shape: tuple[int, ...]
    """The checkpoint tensor's slice this is, in transformers' layout."""
    qtype: object
    take: tuple[int, int, int] | None = None
    """(axis, index, count): this is slice `index` of `count` equal ones along `axis` (Pieces, a token's
    row); None: the whole tensor."""


@dataclass(frozen=True)
class MmprojPlan:
    image_text_class: str
    projector: Projector
    config: object
    tensors: tuple[MmprojTensor, ...]

    def to_gguf(self, item: MmprojTensor, array: np.ndarray) -> np.ndarray:
        """The checkpoint tensor's slice `array` (`taken`) -> this GGUF tensor's values."""
        array = array.reshape(item.shape)
        if item.gguf_name in self.projector.first_row_last:
            array = np.roll(array, -1, axis=0)
        if self._permuted(item):
            array = permute_heads(array, self.config.vision_config.num_attention_heads)
        return array + np.float32(1.0) if item.gguf_name in self.projector.plus_one else array

    def from_gguf(self, item: MmprojTensor, array: np.ndarray) -> np.ndarray:
        """The inverse of to_gguf, as far as this tensor goes: its slice of the checkpoint tensor."""
        array = array - np.float32(1.0) if item.gguf_name in self.projector.plus_one else array
        if self._permuted(item):
            array = unpermute_heads(array, self.config.vision_config.num_attention_heads)
        if item.gguf_name in self.projector.first_row_last:
            array = np.roll(array, 1, axis=0)
        return array.reshape(item.hf_shape)

    def _permuted(self, item: MmprojTensor) -> bool:
        return self.projector.permute_qk and item.gguf_name.endswith(("attn_q.weight", "attn_k.weight"))

    def checkpoint_tensors(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Checkpoint name -> its values in transformers' layout, from each GGUF tensor's values taken
        back (`arrays`: GGUF name -> values): slices joined again; a tensor the file holds only a
        part of (a token's embedding row) left out."""
        out, parts = {}, {}
        for item in self.tensors:
            value = self.from_gguf(item, arrays[item.gguf_name])
            if item.take is None:
                out[item.checkpoint_name] = value
                continue
            parts.setdefault(item.checkpoint_name, []).append((item.take, value))
        for name, pieces in parts.items():
            axis, _, count = pieces[0][0]
            if len(pieces) == count:
                out[name] = np.concatenate([value for _, value in sorted(pieces, key=lambda p: p[0][1])], axis=axis)
        return out


def taken(item: MmprojTensor, tensor):
    """The slice of the checkpoint tensor (torch or numpy) `item` holds (MmprojTensor.take)."""
    if item.take is None:
        return tensor
    axis, index, count = item.take
    size = tensor.shape[axis] // count
    return tensor[(slice(None),) * axis + (slice(index * size, (index + 1) * size),)]


def projector_for(config) -> tuple[str, Projector]:
    """(image-text class name, its Projector); GgufUnsupported in one line where there is none or
    clip.cpp's graph runs another model than this config's."""
    from transformers import AutoModelForImageTextToText

    name = AutoModelForImageTextToText._model_mapping[type(config)].__name__
    if name not in PROJECTORS:
        why = NO_GRAPH.get(name, "llama.cpp's converter registers no mmproj conversion for it that homelab-ft has read")
        raise GgufUnsupported(f"model_type {config.model_type!r} ({name}) cannot be written as GGUF + mmproj by "
                              f"homelab-ft: {why}")
    PROJECTORS[name].check(config)
    return name, PROJECTORS[name]


def plan_mmproj(model_dir: Path, *, gguf_type: str) -> MmprojPlan:
    """Every mmproj tensor of the image-text checkpoint `model_dir`, named and typed, in file order;
    GgufUnsupported where a vision-side tensor has no place in gguf-py's MMPROJ layout."""
    import gguf
    import torch
    from transformers import AutoModelForImageTextToText

    from homelab_ft.export.gguf.text_view import image_text_config, text_names
    from homelab_ft.model.checkpoint_keys import CheckpointKeys

    config = image_text_config(model_dir)
    if config is None:
        raise UserError(f"{model_dir}/config.json is not an image-text model's config")
    class_name, projector = projector_for(config)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    keys = CheckpointKeys(model, model_dir)
    text = set(text_names(config))
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    blocks = max(int(m[1]) + 1 for n in shapes if (m := re.search(r"\.(?:layers?|blocks)\.(\d+)\.", n)) and n not in text)
    # the map expands `{bid}` below its block count, which also numbers the projector's layers
    # (InternVL's mlp1.3 -> mm.model.mlp.3): at least 4, whatever the tower's depth
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(blocks, 4))
    allowed = set(gguf.MODEL_TENSORS[gguf.MODEL_ARCH.MMPROJ])
    items = []
    for name in sorted(keys.names() - text):
        key = name.removeprefix(f"{model.base_model_prefix}.")
        if projector.skip and re.search(projector.skip, key):
            continue
        for part_key, suffix, take in _pieces(key, shapes[name], projector):
            # gguf-py knows some names with the base model's prefix (InternVL's), most without it
            mapped = next(filter(None, (name_map.get_type_and_name(_renamed(k, projector, config),
                                                                   try_suffixes=(".weight", ".bias"))
                                        for k in (part_key, f"{model.base_model_prefix}.{part_key}"))), None)
            if mapped is None or mapped[0] not in allowed:
                raise GgufUnsupported(f"{model_dir}: tensor {name} has no place in llama.cpp's mmproj layout for "
                                      f"{projector.projector_type!r}, so {class_name} cannot be written as GGUF + mmproj")
            items.append(_item(name, mapped, suffix, take, shapes[name], gguf_type, projector))
    items += _token_rows(model, model_dir, projector, shapes)
    return MmprojPlan(class_name, projector, config, tuple(items))


def _pieces(key: str, hf_shape: tuple[int, ...], projector: Projector):
    """(key for gguf-py's map, GGUF name suffix, `take`) of each GGUF tensor the checkpoint tensor `key` is."""
    for pieces in projector.pieces:
        if re.search(pieces.pattern, key):
            if hf_shape[pieces.axis] % len(pieces.parts):
                raise GgufUnsupported(f"{key} of shape {hf_shape} does not split in {len(pieces.parts)} as llama.cpp's "
                                      "converter splits it")
            return [(re.sub(pieces.pattern, replacement, key), suffix, (pieces.axis, index, len(pieces.parts)))
                    for index, (replacement, suffix) in enumerate(pieces.parts)]
    return [(key, "", None)]


def _item(name: str, mapped, suffix: str, take, hf_shape: tuple[int, ...], gguf_type: str,
          projector: Projector) -> MmprojTensor:
    if take is not None:
        axis, _, count = take
        hf_shape = tuple(d // count if i == axis else d for i, d in enumerate(hf_shape))
    shape = tuple(d for d in hf_shape if d != 1) or (1,)
    gguf_name = mapped[1] + suffix
    return MmprojTensor(gguf_name, name, shape, hf_shape, _qtype((mapped[0], gguf_name), shape, gguf_type, projector),
                        take)


def _token_rows(model, model_dir: Path, projector: Projector, shapes: dict) -> list[MmprojTensor]:
    """The language model's input-embedding rows the projector's graph reads (Projector.token_rows),
    found by the token's id in the checkpoint's tokenizer."""
    if not projector.token_rows:
        return []
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    embedding = next(n for n, m in model.named_modules() if m is model.get_input_embeddings()) + ".weight"
    rows = shapes[embedding][0]
    items = []
    for gguf_name, token in projector.token_rows:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(token_id) != token:
            raise GgufUnsupported(f"{model_dir}: the tokenizer has no {token} token, whose embedding llama.cpp's "
                                  f"{projector.projector_type!r} graph reads from the mmproj")
        width = shapes[embedding][1]
        items.append(MmprojTensor(gguf_name, embedding, (width,), (1, width), gguf.GGMLQuantizationType.F32,
                                  (0, token_id, rows)))
    return items


def _renamed(key: str, projector: Projector, config) -> str:
    for pattern, replacement in projector.renames:
        key = re.sub(pattern, replacement, key)
    return projector.rename(key, config) if projector.rename else key


def _qtype(mapped, shape: tuple[int, ...], gguf_type: str, projector: Projector):
    import gguf

    Q = gguf.GGMLQuantizationType
    kind, name = mapped
    if len(shape) > 1 and any(part in name for part in projector.keep_f32):
        return Q.F32
    if len(shape) > 1 and any(part in name for part in projector.keep_f16):
        return Q.F16
    if len(shape) > 1 and ".patch_embd." in name:  # MmprojModel.tensor_force_quant: f16 in an f16 file, else f32
        return Q.F16 if gguf_type == "f16" else Q.F32
    return tensor_qtype(kind, shape, gguf_type, gguf_name=name)


PROCESSOR_FILES = (("preprocessor_config.json", None), ("processor_config.json", "image_processor"))
"""Where an image processor's settings are saved, and the key holding them inside the file (None: the file)."""


def has_processor(model_dir: Path) -> bool:
    return any((Path(model_dir) / file).is_file() for file, _ in PROCESSOR_FILES)


def processor_settings(model_dir: Path) -> dict:
    """The image processor's settings as the converter reads them: preprocessor_config.json, then
    processor_config.json's `image_processor` over it."""
    settings = {}
    for file, inner in PROCESSOR_FILES:
        path = Path(model_dir) / file
        if path.is_file():
            values = json.loads(path.read_text())
            settings.update({**values, **(values.get(inner) or {})} if inner else values)
    if "image_mean" not in settings or "image_std" not in settings:
        raise UserError(f"{model_dir}: no image processor settings (preprocessor_config.json or processor_config.json "
                        "with image_mean and image_std); save the model's processor with it to write its mmproj")
    return settings


def _vision_hparams(config, processor: dict) -> dict[str, object]:
    """MmprojModel.set_gguf_parameters' keys, from the vision config (transformers' own attribute
    names, which the converter looks up among several spellings); None where the config has none
    (Qwen's image size, which the family's keys give)."""
    vision = config.vision_config

    def first(*names):
        value = next((getattr(vision, n) for n in names if getattr(vision, n, None) is not None), None)
        return value[0] if isinstance(value, list | tuple) else value

    return {
        "add_clip_has_vision_encoder": True,
        "add_vision_projection_dim": config.get_text_config().hidden_size,
        "add_vision_image_size": first("image_size"),
        "add_vision_patch_size": first("patch_size"),
        "add_vision_embedding_length": first("hidden_size", "embed_dim"),
        "add_vision_feed_forward_length": first("intermediate_size"),
        "add_vision_block_count": first("num_hidden_layers", "depth"),
        "add_vision_head_count": first("num_attention_heads", "num_heads"),
        "add_vision_image_mean": [float(v) for v in processor["image_mean"]],
        "add_vision_image_std": [float(v) for v in processor["image_std"]],
    }


def mmproj_keys(plan: MmprojPlan, processor_dir: Path) -> dict[str, object]:
    """GGUFWriter method -> value for every hyperparameter the mmproj holds (`processor_dir`: the
    folder with the model's image processor settings)."""
    processor = processor_settings(processor_dir)
    keys = {**_vision_hparams(plan.config, processor), "add_clip_projector_type": plan.projector.projector_type,
            **plan.projector.extra_keys(plan.config, processor)}
    missing = [method for method, value in keys.items() if value is None]
    if missing:
        raise GgufUnsupported(f"{plan.image_text_class}: its vision config has no value for {missing[0]} "
                              "(llama.cpp's mmproj needs it), so homelab-ft cannot write its mmproj")
    return keys


def write_mmproj(model_dir: Path, out_path: Path, *, gguf_type: str, name: str,
                 processor_dir: Path | None = None) -> MmprojPlan:
    """Write the vision tower and projector of `model_dir` as llama.cpp's mmproj GGUF at `out_path`;
    the image processor's settings are read from `processor_dir` (default: `model_dir`)."""
    import gguf
    import torch
    from transformers import AutoModelForImageTextToText

    from homelab_ft.export.gguf.hparams import FILE_TYPES
    from homelab_ft.model.checkpoint_keys import CheckpointKeys

    plan = plan_mmproj(model_dir, gguf_type=gguf_type)
    keys = mmproj_keys(plan, processor_dir or model_dir)
    with torch.device("meta"):
        checkpoint = CheckpointKeys(AutoModelForImageTextToText.from_config(plan.config), model_dir)
    writer = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    try:
        writer.add_type(gguf.GGUFType.MMPROJ)
        writer.add_name(name)
        writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[gguf_type]))
        for method, value in keys.items():
            getattr(writer, method)(value)
        from gguf.quants import quant_shape_to_byte_shape

        for item in plan.tensors:
            nbytes = int(np.prod(quant_shape_to_byte_shape(item.shape, item.qtype)))
            writer.add_tensor_info(item.gguf_name, item.shape, np.float32, nbytes, raw_dtype=item.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        by_name: dict[str, list[MmprojTensor]] = {}
        for item in plan.tensors:  # a split tensor's pieces are consecutive: the file's order is kept
            by_name.setdefault(item.checkpoint_name, []).append(item)
        for checkpoint_name, tensor in checkpoint.tensors(list(by_name)):
            for item in by_name[checkpoint_name]:
                values = taken(item, tensor).to(torch.float32).numpy()
                writer.write_tensor_data(encode(plan.to_gguf(item, values), item.qtype))
    finally:
        writer.close()
    log.info("wrote %s (clip, projector %s): %d tensors, %s", out_path, plan.projector.projector_type,
             len(plan.tensors), gguf_type)
    return plan
