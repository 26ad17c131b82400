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
llama.cpp's graph: PROJECTORS holds, per image-text class llama.cpp's converter registers, the
projector type, the converter's renames and value transforms, the tensors it keeps in f32/f16 and
the family's extra keys. A family outside PROJECTORS is refused in one line (the safetensors export
is unaffected): its conversion has not been read here, or llama.cpp has no graph for it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from homelab_ft.errors import UserError
from homelab_ft.export.gguf.arch import GgufUnsupported
from homelab_ft.export.gguf.export import encode, tensor_qtype

log = logging.getLogger(__name__)

MMPROJ_FILE = "mmproj-{gguf_type}.gguf"


def mmproj_type(gguf_type: str) -> str:
    """The mmproj's type for a text GGUF of `gguf_type`: the same down to q8_0, f16 below it. The
    vision tower is small (SigLIP-400M is 0.8 GB in f16) and llama.cpp's own releases of these models
    (ggml-org's SmolVLM, Gemma 3 and InternVL 3 GGUFs) ship the mmproj in f16 or q8_0 beside any text
    quantization; 4-bit vision weights are not offered there."""
    return gguf_type if gguf_type in ("f32", "f16", "bf16", "q8_0") else "f16"


@dataclass(frozen=True)
class Projector:
    """How convert_hf_to_gguf.py writes one image-text class's mmproj (module docstring)."""

    projector_type: str
    """gguf.VisionProjectorType value, `clip.projector_type`: the graph clip.cpp builds."""
    source: str
    """The converter class read, and what of llama.cpp it was checked against."""
    renames: tuple[tuple[str, str], ...] = ()
    """(regex, replacement) on transformers' parameter name before gguf-py's map, as the converter renames."""
    skip: str | None = None
    """Regex of parameters the converter leaves out."""
    plus_one: tuple[str, ...] = ()
    """GGUF names written as 1 + w: an RMSNorm that computes x * (1 + w), whose graph in clip.cpp is x * w."""
    first_row_last: tuple[str, ...] = ()
    """GGUF names whose first row is written last: a position table whose class-token row llama.cpp's
    graph reads after the patches' rows (module docstring of PROJECTORS' InternVL entry)."""
    keep_f32: tuple[str, ...] = ()
    """Substrings of GGUF names always written in f32 (the converter's tensor_force_quant)."""
    keep_f16: tuple[str, ...] = ()
    """Substrings of GGUF names written in f16 whatever the type (the converter's tensor_force_quant)."""
    extra_keys: Callable[[object, dict], dict[str, object]] = field(default=lambda config, processor: {})
    """The family's own `clip.*` keys: GGUFWriter method name -> value."""


def _vision_act(config) -> dict[str, object]:
    act = config.vision_config.hidden_act
    if act in ("gelu", "gelu_pytorch_tanh", "gelu_new"):
        return {"add_vision_use_gelu": True}
    if act == "silu":
        return {"add_vision_use_silu": True}
    raise GgufUnsupported(f"vision hidden_act {act!r} has no clip.cpp equivalent homelab-ft knows")


def _idefics3_keys(config, processor: dict) -> dict[str, object]:
    vision = config.vision_config
    longest = (processor.get("size") or {}).get("longest_edge", vision.image_size)
    return {"add_vision_attention_layernorm_eps": vision.layer_norm_eps, "add_vision_projector_scale_factor":
            config.scale_factor, "add_vision_use_gelu": True, "add_vision_preproc_image_size": longest}


def _gemma3_keys(config, processor: dict) -> dict[str, object]:
    vision = config.vision_config
    keys = {"add_vision_attention_layernorm_eps": vision.layer_norm_eps, "add_vision_use_gelu": True}
    per_side = int(round(config.mm_tokens_per_image ** 0.5))
    scale = (vision.image_size // vision.patch_size) // per_side
    if scale != 4:  # clip.cpp's default for gemma3 (896 px / 14 px = 64 patches a side, 16 tokens a side)
        keys["add_vision_projector_scale_factor"] = scale
    return keys


def _internvl_keys(config, processor: dict) -> dict[str, object]:
    return {"add_vision_attention_layernorm_eps": config.vision_config.layer_norm_eps, **_vision_act(config),
            "add_vision_projector_scale_factor": int(round(1.0 / config.downsample_ratio))}


PROJECTORS = {
    "Idefics3ForConditionalGeneration": Projector(
        "idefics3", "conversion/smolvlm.py SmolVLMModel (llama.cpp b11739: clip.cpp PROJECTOR_TYPE_IDEFICS3)",
        keep_f32=(".position_embd.", ".patch_embd."), extra_keys=_idefics3_keys),
    "SmolVLMForConditionalGeneration": Projector(
        "idefics3", "conversion/smolvlm.py SmolVLMModel (llama.cpp b11739: clip.cpp PROJECTOR_TYPE_IDEFICS3)",
        keep_f32=(".position_embd.", ".patch_embd."), extra_keys=_idefics3_keys),
    "Gemma3ForConditionalGeneration": Projector(
        "gemma3", "conversion/gemma.py Gemma3VisionModel (llama.cpp b11739: clip.cpp PROJECTOR_TYPE_GEMMA3)",
        renames=((r"^vision_tower\.(?!vision_model\.)", "vision_tower.vision_model."), (r"_weight$", ".weight")),
        skip=r"^vision_tower\.(vision_model\.)?head\.", plus_one=("mm.soft_emb_norm.weight",),
        keep_f32=(".position_embd.", ".patch_embd."), keep_f16=("mm.input_projection",), extra_keys=_gemma3_keys),
    "InternVLForConditionalGeneration": Projector(
        "internvl", "conversion/intern_vision.py InternVisionModel (llama.cpp b11739: clip.cpp PROJECTOR_TYPE_INTERNVL)",
        renames=((r"^multi_modal_projector\.layer_norm\.", "mlp1.0."), (r"^multi_modal_projector\.linear_1\.", "mlp1.1."),
                 (r"^multi_modal_projector\.linear_2\.", "mlp1.3."),
                 (r"(\.lambda_\d|position_embeddings)$", r"\1.weight")),  # the converter's `name += ".weight"`
        first_row_last=("v.position_embd.weight",), keep_f32=(".position_embd.",), extra_keys=_internvl_keys),
}
"""Image-text class -> its mmproj conversion, read from llama.cpp's converter (`source`); the class
names are those its converter registers the MmprojModel subclass under.

One departure from the converter, measured: llama.cpp b11739's InternVL graph (models/internvl.cpp)
appends the class token after the patches and adds the position table's rows in order, so the
converter's file (class-token row first, as transformers adds it) gives each patch its neighbour's
position: on the tiny test model llama.cpp's image embeddings then differ from transformers' by 9% of
their largest value. Written with the class-token row last, llama.cpp computes transformers' model
(2.4e-5 of 0.094 in f32; tests/unit/export/gguf/test_gguf_mmproj_llama_cpp.py)."""

NO_GRAPH = {
    "Qwen2VLForConditionalGeneration": "its language model is llama.cpp's `qwen2vl` (M-RoPE sections), a text "
                                       "architecture homelab-ft does not write yet",
    "Qwen2_5_VLForConditionalGeneration": "its language model is llama.cpp's `qwen2vl` (M-RoPE sections), a text "
                                          "architecture homelab-ft does not write yet",
    "Qwen3VLForConditionalGeneration": "its language model is llama.cpp's `qwen3vl` (M-RoPE and deepstack "
                                       "features), which homelab-ft does not write yet",
    "Mistral3ForConditionalGeneration": "llama.cpp's converter writes its language model as `mistral3` and the "
                                        "Pixtral tower with the [IMG_BREAK] embedding, a conversion homelab-ft has "
                                        "not written yet",
}
"""Image-text classes llama.cpp runs whose conversion homelab-ft has not written, and why."""


@dataclass(frozen=True)
class MmprojTensor:
    gguf_name: str
    checkpoint_name: str
    """transformers' parameter name (what CheckpointKeys reads)."""
    shape: tuple[int, ...]
    """In the GGUF, numpy order: the checkpoint's less its unit dimensions (the converter's squeeze)."""
    hf_shape: tuple[int, ...]
    qtype: object


@dataclass(frozen=True)
class MmprojPlan:
    image_text_class: str
    projector: Projector
    config: object
    tensors: tuple[MmprojTensor, ...]

    def to_gguf(self, item: MmprojTensor, array: np.ndarray) -> np.ndarray:
        array = array.reshape(item.shape)
        if item.gguf_name in self.projector.first_row_last:
            array = np.roll(array, -1, axis=0)
        return array + np.float32(1.0) if item.gguf_name in self.projector.plus_one else array

    def from_gguf(self, item: MmprojTensor, array: np.ndarray) -> np.ndarray:
        array = array - np.float32(1.0) if item.gguf_name in self.projector.plus_one else array
        if item.gguf_name in self.projector.first_row_last:
            array = np.roll(array, 1, axis=0)
        return array.reshape(item.hf_shape)


def projector_for(config) -> tuple[str, Projector]:
    """(image-text class name, its Projector); GgufUnsupported in one line where there is none."""
    from transformers import AutoModelForImageTextToText

    name = AutoModelForImageTextToText._model_mapping[type(config)].__name__
    if name in PROJECTORS:
        return name, PROJECTORS[name]
    why = NO_GRAPH.get(name, "llama.cpp's converter registers no mmproj conversion for it that homelab-ft has read")
    raise GgufUnsupported(f"model_type {config.model_type!r} ({name}) cannot be written as GGUF + mmproj by "
                          f"homelab-ft: {why}")


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
        # gguf-py knows some names with the base model's prefix (InternVL's), most without it
        mapped = next(filter(None, (name_map.get_type_and_name(_renamed(k, projector), try_suffixes=(".weight", ".bias"))
                                    for k in (key, name))), None)
        if mapped is None or mapped[0] not in allowed:
            raise GgufUnsupported(f"{model_dir}: tensor {name} has no place in llama.cpp's mmproj layout for "
                                  f"{projector.projector_type!r}, so {class_name} cannot be written as GGUF + mmproj")
        hf_shape = shapes[name]
        shape = tuple(d for d in hf_shape if d != 1) or (1,)
        items.append(MmprojTensor(mapped[1], name, shape, hf_shape, _qtype(mapped, shape, gguf_type, projector)))
    return MmprojPlan(class_name, projector, config, tuple(items))


def _renamed(key: str, projector: Projector) -> str:
    for pattern, replacement in projector.renames:
        key = re.sub(pattern, replacement, key)
    return key


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
    names, which the converter looks up among several spellings)."""
    vision = config.vision_config

    def first(*names):
        value = next(getattr(vision, n) for n in names if getattr(vision, n, None) is not None)
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
    return {**_vision_hparams(plan.config, processor), "add_clip_projector_type": plan.projector.projector_type,
            **plan.projector.extra_keys(plan.config, processor)}


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
        by_name = {item.checkpoint_name: item for item in plan.tensors}
        for checkpoint_name, tensor in checkpoint.tensors([item.checkpoint_name for item in plan.tensors]):
            item = by_name[checkpoint_name]
            writer.write_tensor_data(encode(plan.to_gguf(item, tensor.to(torch.float32).numpy()), item.qtype))
    finally:
        writer.close()
    log.info("wrote %s (clip, projector %s): %d tensors, %s", out_path, plan.projector.projector_type,
             len(plan.tensors), gguf_type)
    return plan
