"""How llama.cpp's converter writes the mmproj of each image-text class homelab-ft writes: what
mmproj.py cannot derive from transformers and gguf-py, read from convert_hf_to_gguf.py (its
MmprojModel subclass registered for the class) and checked against llama.cpp b11739's clip.cpp
graphs by running them (tests/unit/export/gguf/test_gguf_mmproj_llama_cpp.py).

A `Projector` holds the graph clip.cpp builds (`clip.projector_type`), the converter's renames and
value transforms, the tensors it keeps in f32/f16, the family's own `clip.*` keys and the settings
llama.cpp's graph fixes, refused when a config differs. PROJECTORS maps the image-text class names
llama.cpp's converter registers to them; a class outside it is refused in one line (the safetensors
export is unaffected).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from homelab_ft.export.gguf.arch import GgufUnsupported


@dataclass(frozen=True)
class Pieces:
    """One checkpoint tensor written as several GGUF tensors, each an equal slice along `axis`, as the
    converter splits them: Qwen2-VL's fused q/k/v rows, its Conv3d patch kernel's two time steps."""

    pattern: str
    """Regex of the checkpoint key (less the base model's prefix) to split."""
    axis: int
    parts: tuple[tuple[str, str], ...]
    """Per slice, in order: (what `pattern` is replaced by before gguf-py's name map, a suffix added
    to the GGUF name the map gives)."""


@dataclass(frozen=True)
class Projector:
    """How convert_hf_to_gguf.py writes one image-text class's mmproj (module docstring)."""

    projector_type: str
    """gguf.VisionProjectorType value, `clip.projector_type`: the graph clip.cpp builds."""
    source: str
    """The converter class read, and what of llama.cpp it was checked against."""
    renames: tuple[tuple[str, str], ...] = ()
    """(regex, replacement) on transformers' parameter name before gguf-py's map, as the converter renames."""
    rename: Callable[[str, object], str] | None = None
    """A rename that reads the config (Qwen3-VL's deepstack mergers, numbered by the layer they tap)."""
    skip: str | None = None
    """Regex of parameters the converter leaves out."""
    pieces: tuple[Pieces, ...] = ()
    plus_one: tuple[str, ...] = ()
    """GGUF names written as 1 + w: an RMSNorm that computes x * (1 + w), whose graph in clip.cpp is x * w."""
    first_row_last: tuple[str, ...] = ()
    """GGUF names whose first row is written last: a position table whose class-token row llama.cpp's
    graph reads after the patches' rows (PROJECTORS' InternVL note)."""
    permute_qk: bool = False
    """The vision tower's q/k rows permuted per head as LlamaModel.permute does (Pixtral's 2D rope,
    which llama.cpp turns on interleaved pairs)."""
    token_rows: tuple[tuple[str, str], ...] = ()
    """(GGUF name, token): a row of the language model's input embedding the graph reads (Pixtral's
    [IMG_BREAK], put between the image's rows of patches)."""
    keep_f32: tuple[str, ...] = ()
    """Substrings of GGUF names always written in f32 (the converter's tensor_force_quant)."""
    keep_f16: tuple[str, ...] = ()
    """Substrings of GGUF names written in f16 whatever the type (the converter's tensor_force_quant)."""
    extra_keys: Callable[[object, dict], dict[str, object]] = field(default=lambda config, processor: {})
    """The family's own `clip.*` keys, and its values of the common ones where they are not the vision
    config's: GGUFWriter method name -> value."""
    check: Callable[[object], None] = field(default=lambda config: None)
    """GgufUnsupported for a config whose model clip.cpp's graph would run otherwise."""
    image_area: Callable[[object, dict], tuple[int, int, int]] | None = None
    """(fewest, most pixels, pixels per image token) the image processor sizes an image into, for
    the graphs whose images llama.cpp sizes by the same rule, bounded in tokens by its
    --image-min-tokens / --image-max-tokens (Qwen's smart resize, whose default llama.cpp bounds,
    8-4096 tokens, are not the processor's); None where llama.cpp's rule is another (Pixtral's
    longest edge, which llama.cpp turns into an area)."""


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


QWEN_VISION_EPS = 1e-6
"""The norms of Qwen2/2.5/3-VL's vision blocks and merger (LayerNorm / RMSNorm(eps=1e-6) in
transformers' modeling files; their configs hold no epsilon), the converter's default for
clip.vision.attention.layer_norm_epsilon."""

QWEN_IMAGE_SIZE = 560
"""What Qwen2VLVisionModel writes as clip.vision.image_size (the configs have none); clip.cpp sizes
Qwen images itself (8 to 4096 tokens), so it is read only for the warm-up."""


def _fixed(config, where: str, key: str, want, *, source: str) -> None:
    got = getattr(config, key, None)
    if got != want:
        raise GgufUnsupported(f"{where}.{key} = {got!r}, but llama.cpp b11739's {source} runs {want!r} (no GGUF key "
                              "carries another value), so homelab-ft cannot write its mmproj")


def _qwen2vl_check(config) -> None:
    vision = config.vision_config
    _fixed(vision, "vision_config", "spatial_merge_size", 2, source="qwen2vl graph (models/qwen2vl.cpp: 2x2 merge)")
    _fixed(vision, "vision_config", "temporal_patch_size", 2, source="converter (Qwen2VLVisionModel: two Conv2d kernels)")
    if config.model_type == "qwen2_vl":
        _fixed(vision, "vision_config", "hidden_act", "quick_gelu", source="qwen2vl graph")
    else:
        _fixed(vision, "vision_config", "hidden_act", "silu", source="qwen2.5vl graph (its gated SiLU MLP)")
        _fixed(vision, "vision_config", "window_size", 112, source="qwen2.5vl window attention (clip.cpp: 112 px)")
        _wa_pattern(vision)


def _wa_pattern(vision) -> int:
    """Qwen2.5-VL's full-attention blocks as llama.cpp's one period (`n_wa_pattern`): every n-th
    block attends to the whole image, the others within windows; the converter refuses another layout."""
    full = list(vision.fullatt_block_indexes)
    period = full[0] + 1
    if [b - a for a, b in zip([-1, *full], full, strict=False)] != [period] * len(full):
        raise GgufUnsupported(f"vision_config.fullatt_block_indexes = {full} is not every {period}th block, the one "
                              "pattern llama.cpp's qwen2.5vl graph runs (clip.vision.n_wa_pattern)")
    return period


def _qwen2vl_keys(config, processor: dict) -> dict[str, object]:
    vision = config.vision_config
    keys = {"add_vision_image_size": QWEN_IMAGE_SIZE, "add_vision_attention_layernorm_eps": QWEN_VISION_EPS,
            "add_vision_spatial_merge_size": vision.spatial_merge_size}
    if config.model_type == "qwen2_vl":  # its vision config's hidden_size is the merger's output width
        return {**keys, "add_vision_embedding_length": vision.embed_dim,
                "add_vision_feed_forward_length": int(vision.embed_dim * vision.mlp_ratio)}
    return {**keys, "add_vision_use_silu": True, "add_vision_n_wa_pattern": _wa_pattern(vision)}


def _qwen_image_area(config, processor: dict) -> tuple[int, int, int]:
    """Qwen2VLImageProcessor's bounds (`size` shortest / longest edge, which hold pixel areas, or the
    older min_pixels / max_pixels) and its area per merged token, (patch_size x merge_size)^2."""
    size = processor.get("size") or {}
    low, high = size.get("shortest_edge", processor.get("min_pixels")), size.get("longest_edge", processor.get("max_pixels"))
    if low is None or high is None:
        raise GgufUnsupported("the image processor names no min / max pixels, which llama.cpp's Qwen graphs need "
                              "to size images as in training")
    vision = config.vision_config
    side = processor.get("patch_size", vision.patch_size) * processor.get("merge_size", vision.spatial_merge_size)
    return int(low), int(high), side * side


def _qwen3vl_keys(config, processor: dict) -> dict[str, object]:
    vision = config.vision_config
    deepstack = set(vision.deepstack_visual_indexes)
    side = int(round(vision.num_position_embeddings ** 0.5))
    return {"add_vision_image_size": side * vision.patch_size, "add_vision_use_gelu": True,
            "add_vision_spatial_merge_size": vision.spatial_merge_size,
            "add_vision_attention_layernorm_eps": QWEN_VISION_EPS,
            "add_vision_is_deepstack_layers": [i in deepstack for i in range(vision.depth)]}


def _qwen3vl_check(config) -> None:
    vision = config.vision_config
    _fixed(vision, "vision_config", "temporal_patch_size", 2, source="converter (Qwen3VLVisionModel: two Conv2d kernels)")
    _fixed(vision, "vision_config", "hidden_act", "gelu_pytorch_tanh", source="qwen3vl graph (GELU, tanh form)")
    side = int(round(vision.num_position_embeddings ** 0.5))
    if side * side != vision.num_position_embeddings:
        raise GgufUnsupported(f"vision_config.num_position_embeddings = {vision.num_position_embeddings} is not a "
                              "square grid, which llama.cpp's qwen3vl graph interpolates")


def _qwen3vl_rename(key: str, config) -> str:
    """deepstack_merger_list.i -> the index of the vision block it taps (the converter's absolute index)."""
    indexes = config.vision_config.deepstack_visual_indexes
    return re.sub(r"deepstack_merger_list\.(\d+)\.", lambda m: f"deepstack_merger_list.{indexes[int(m[1])]}.", key)


PIXTRAL_EPS = 1e-5
"""PixtralRMSNorm's epsilon in transformers' modeling_pixtral.py (the config holds none), which
LlavaVisionModel writes as clip.vision.attention.layer_norm_epsilon."""


def _pixtral_keys(config, processor: dict) -> dict[str, object]:
    return {"add_vision_attention_layernorm_eps": PIXTRAL_EPS, **_vision_act(config),
            "add_vision_spatial_merge_size": config.spatial_merge_size}


def _pixtral_check(config) -> None:
    from homelab_ft.export.gguf.arch import rope_parameters

    _fixed(config, "config", "vision_feature_layer", -1, source="pixtral graph (the tower's last layer)")
    _fixed(config, "config", "projector_hidden_act", "gelu", source="pixtral graph (its projector's GELU)")
    theta = rope_parameters(config.vision_config).get("rope_theta")
    if theta != 10000.0:
        raise GgufUnsupported(f"vision_config rope_theta = {theta}, but llama.cpp b11739 runs the Pixtral tower's "
                              "2D rope at 10000 (clip.cpp, no GGUF key), so homelab-ft cannot write its mmproj")


_QWEN_QKV = Pieces(r"\.attn\.qkv\.", axis=0, parts=((".attn.q.", ""), (".attn.k.", ""), (".attn.v.", "")))
_CONV3D = Pieces(r"^visual\.patch_embed\.proj\.weight$", axis=2,
                 parts=(("visual.patch_embed.proj.weight", ""), ("visual.patch_embed.proj.weight", ".1")))
_QWEN2VL = dict(pieces=(_QWEN_QKV, _CONV3D), keep_f32=(".position_embd.",), extra_keys=_qwen2vl_keys,
                check=_qwen2vl_check, image_area=_qwen_image_area)

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
    "Qwen2VLForConditionalGeneration": Projector(
        "qwen2vl_merger", "conversion/qwenvl.py Qwen2VLVisionModel (llama.cpp b11739: models/qwen2vl.cpp)", **_QWEN2VL),
    "Qwen2_5_VLForConditionalGeneration": Projector(
        "qwen2.5vl_merger", "conversion/qwenvl.py Qwen2VLVisionModel (llama.cpp b11739: models/qwen2vl.cpp, windows)",
        **_QWEN2VL),
    "Qwen3VLForConditionalGeneration": Projector(
        "qwen3vl_merger", "conversion/qwen3vl.py Qwen3VLVisionModel (llama.cpp b11739: models/qwen3vl.cpp)",
        renames=((r"^visual\.merger\.linear_fc1\.", "visual.merger.mlp.0."),
                 (r"^visual\.merger\.linear_fc2\.", "visual.merger.mlp.2."), (r"^visual\.merger\.norm\.", "visual.merger.ln_q.")),
        rename=_qwen3vl_rename, pieces=(_CONV3D,), keep_f32=(".position_embd.",), extra_keys=_qwen3vl_keys,
        check=_qwen3vl_check, image_area=_qwen_image_area),
    "Mistral3ForConditionalGeneration": Projector(
        "pixtral", "conversion/llava.py LlavaVisionModel (llama.cpp b11739: clip.cpp PROJECTOR_TYPE_PIXTRAL)",
        permute_qk=True, token_rows=(("v.token_embd.img_break", "[IMG_BREAK]"),), extra_keys=_pixtral_keys,
        check=_pixtral_check),
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
    "Qwen3VLMoeForConditionalGeneration": "its language model is llama.cpp's `qwen3vlmoe`, whose fused experts "
                                          "(gate_up_proj transposed and split by the converter) the text view of an "
                                          "image-text model does not write yet",
}
"""Image-text classes llama.cpp runs whose conversion homelab-ft has not written, and why."""
