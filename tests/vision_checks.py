"""The planner's checks of an image-text family against transformers itself, shared by the unit
tests (tests/tiny_vlm.UNIT_FAMILIES) and tests/e2e/test_vision_families.py (the rest of MEASURED):
the family is planned with every loaded weight priced once, the vision side's measured bytes are a
real fp32 CPU forward's, the counted image tokens are what the real model accepts and what the real
processor expands an image to. The models are tests/tiny_vlm.py's."""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import image_processor

TOKEN_SIZES = ((84, 112), (336, 448), (300, 1000), (1000, 300))
"""(height, width) of the images counted: none of them the vision measurement's squares."""


def derived_shape(folder: Path):
    import json

    from homelab_ft.plan.shape.shapes import model_shape

    return model_shape(json.loads((folder / "config.json").read_text()), model_path=str(folder), images=True)


def counted_tokens(folder: Path, sizes=TOKEN_SIZES) -> tuple[int, ...]:
    import json

    from homelab_ft.plan.shape.cache import cached_image_tokens

    return cached_image_tokens(json.loads((folder / "config.json").read_text()), sizes=sizes, model_path=str(folder))


def check_planned_whole(model_type: str, folder: Path) -> None:
    """The family is planned with every loaded weight priced once: the language model's blocks as a
    causal LM's, the vision side (tower and projector, each of its linear layers) beside them."""
    import torch
    from transformers import AutoModelForImageTextToText

    shape = derived_shape(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder)
    language = model.get_decoder()
    assert shape.total_params + shape.vision_params == sum(p.numel() for p in model.parameters())
    assert shape.num_layers == len(language.layers) and shape.model_type == model.config.get_text_config().model_type
    assert not shape.vision.unmeasured and shape.vision.image_processor == type(image_processor(model_type)).__name__
    inside = {id(m) for m in language.modules()} | {id(model.get_output_embeddings())}
    vision_linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and id(m) not in inside}
    assert {lin.name for lin in shape.vision.linears} == vision_linears


def _real_saved_and_peak(model, inputs) -> tuple[int, int, int]:
    """(image tokens, bytes saved for backward, the most bytes held at once without grad) of the real
    model's vision side: its own kernels, no stand-in."""
    import torch

    from homelab_ft.plan.shape import vision

    skip = {vision._storage_id(t) for t in (*model.parameters(), *model.buffers(), *inputs.values())}
    sizes: dict[int, int] = {}
    keep: list = []

    def pack(t):
        keep.append(t)
        if vision._storage_id(t) not in skip:
            sizes[vision._storage_id(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tokens = vision._rows(model.get_image_features(**inputs))
    tracker = vision._RealUntilWeights(track=True)
    with tracker, torch.no_grad():
        model.get_image_features(**inputs)
    return tokens, sum(sizes.values()), tracker.peak


def check_against_real_forward(model_type: str, folder: Path) -> None:
    """At 448 x 336 px (never measured: the three measured images are square), the tokens the shape
    predicts are what the real vision side returns, and its saved and held bytes per image are the
    real fp32 CPU forward's within 3%. Costs follow patches, priced through image tokens at a fixed
    number of patches per token: where a grid side is odd (Pixtral merges 2x2 patches and drops the
    odd column), the image costs more than priced: 6% more saved bytes at 560 x 392 on the tiny
    Pixtral (23 patch columns), under 3% at a real 1024 x 768 photo (73)."""
    import pytest
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from homelab_ft.plan.shape import vision

    sight = derived_shape(folder).vision
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder), attn_implementation="sdpa")
    inputs = vision.vision_inputs(model, image_processor(model_type), height=336, width=448)
    tokens, saved, peak = _real_saved_and_peak(model, inputs)
    assert tokens == vision.image_tokens(model, inputs) > 0
    assert saved == pytest.approx(sight.saved_bytes(4, tokens), rel=0.03)
    assert peak == pytest.approx(sight.transient_bytes(4, tokens), rel=0.03)
    assert sight.forward_flops(tokens) > sight.forward_flops(tokens / 2) > 0


def check_accepted_tokens(folder: Path) -> None:
    """The real model accepts exactly the counted image tokens beside each image of TOKEN_SIZES: its
    own "Image features and image tokens do not match" check refuses one more."""
    import pytest
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder)
    processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
    start = [model.config.vision_start_token_id] if getattr(model.config, "vision_start_token_id", None) else []
    image_token = getattr(model.config, "image_token_id", None)
    image_token = getattr(model.config, "image_token_index", None) if image_token is None else image_token
    for (height, width), tokens in zip(TOKEN_SIZES, counted_tokens(folder), strict=True):
        pixels = {k: v for k, v in processor(images=[Image.new("RGB", (width, height))], return_tensors="pt").items()
                  if k not in ("num_crops", "num_patches")}

        def forward(count: int, pixels=pixels):
            ids = torch.tensor([[5, 6, *start, *[image_token] * count, 7]])
            with torch.no_grad():
                return model(input_ids=ids, mm_token_type_ids=(ids == image_token).int(), **pixels)

        assert forward(tokens).logits.shape[1] == tokens + len(start) + 3
        with pytest.raises(ValueError, match="Image features and image tokens do not match"):
            forward(tokens + 1)


def check_more_pixels(folder: Path) -> None:
    """More pixels never give fewer tokens (sides 56 to 952 px, 4:3)."""
    counted = counted_tokens(folder, tuple((side, side * 4 // 3) for side in range(56, 1008, 224)))
    assert list(counted) == sorted(counted) and counted[0] > 0


def real_processor(model_type: str, folder: Path):
    """The family's real processor (Llava and Gemma 3 as saved; PaliGemma's, which the folder does not
    keep, built from the folder's tokenizer and image processor: the others need torchvision or
    num2words here), and the text and token of one image placeholder."""
    import transformers
    from transformers import AutoProcessor, AutoTokenizer

    if model_type == "paligemma":
        pixels = image_processor("paligemma")
        pixels.image_seq_length = 4  # what a PaliGemma checkpoint's preprocessor_config.json carries
        return (transformers.PaliGemmaProcessor(image_processor=pixels, tokenizer=AutoTokenizer.from_pretrained(folder)),
                "<image>hi", "<image>")
    processor = AutoProcessor.from_pretrained(folder)
    return processor, f"{processor.image_token}hi", processor.tokenizer.image_token


def check_processor_expansion(model_type: str, folder: Path) -> None:
    """The real processor expands the placeholder of each image of TOKEN_SIZES to the counted tokens."""
    from PIL import Image

    processor, text, token = real_processor(model_type, folder)
    token_id = processor.tokenizer.convert_tokens_to_ids(token)
    for (height, width), tokens in zip(TOKEN_SIZES, counted_tokens(folder), strict=True):
        ids = processor(text=[text], images=[Image.new("RGB", (width, height))], return_tensors="pt")["input_ids"]
        assert int((ids == token_id).sum()) == tokens


# --------------------------------------------------------------------------------------------
# the GGUF + mmproj export of a family (tests/unit/export/gguf/test_gguf_mmproj.py on a few families,
# tests/e2e/test_gguf_vision_families.py on the rest), on tiny_vlm.save_gguf_vlm's models

GGUF_FAMILIES = ("idefics3", "smolvlm", "gemma3", "internvl", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "mistral3")
"""Families written as llama.cpp's mmproj; all but SmolVLM (Idefics3's decoder) as a text GGUF too."""

TEXT_ARCH = {"idefics3": "llama", "gemma3": "gemma3", "internvl": "qwen2", "qwen2_vl": "qwen2vl",
             "qwen2_5_vl": "qwen2vl", "qwen3_vl": "qwen3vl", "mistral3": "llama"}
"""The architecture llama.cpp's converter writes each family's language model as (Mistral 3's:
`llama`, as any Mistral decoder, where the converter writes `mistral3`; docs/export.md)."""


def check_mmproj_f32(model_dir: Path, model_type: str, tmp_path: Path) -> None:
    """Every vision-side tensor of an f32 mmproj bit for bit, and the features of the tower loaded back
    from it equal the model's (Gemma 3's input projection is f16 as llama.cpp's converter keeps it)."""
    import gguf

    from homelab_ft.export.gguf import mmproj, mmproj_check

    path = tmp_path / "mmproj-f32.gguf"
    plan = mmproj.write_mmproj(model_dir, path, gguf_type="f32", name="tiny")
    check = mmproj_check.verify_mmproj(path, model_dir, gguf_type="f32")
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "clip"
    assert reader.fields["general.type"].contents() == "mmproj"
    assert reader.fields["clip.projector_type"].contents() == plan.projector.projector_type
    names = {t.name for t in reader.tensors}
    assert names >= {"v.patch_embd.weight", "v.blk.1.ffn_down.weight"}
    assert "v.blk.0.attn_qkv.weight" in names if model_type == "qwen3_vl" else "v.blk.0.attn_q.weight" in names
    if model_type == "gemma3":
        assert check.stored_as == "f16" and 0 < check.max_abs_diff <= check.bound
    else:
        assert check.max_abs_diff == 0.0


def check_text_gguf(model_dir: Path, model_type: str, tmp_path: Path) -> None:
    """The language model laid out as its causal LM (Qwen-VL's as its Qwen2 / Qwen3 twin) gives the
    image-text model's text-only logits, and its GGUF, in the architecture llama.cpp runs it as
    (Qwen-VL's with its M-RoPE sections, Qwen3-VL's with its deepstack count), passes the text
    export's own check (tensors, tokenizer, logits)."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from homelab_ft.export.gguf import check as gguf_check
    from homelab_ft.export.gguf import export as gguf_export
    from homelab_ft.export.gguf import text_view

    view = text_view.write_text_view(model_dir, tmp_path / "text")
    ids = torch.tensor([[1, 5, 9, 14, 30, 2]])
    with torch.no_grad():
        want = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(view, dtype=torch.float32)(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    path = tmp_path / "model-f32.gguf"
    gguf_export.write_gguf(view, path, gguf_type="f32", name="tiny")
    assert gguf_check.verify_gguf(path, view, gguf_type="f32").max_abs_diff < 1e-4
    fields = gguf.GGUFReader(path).fields
    arch = TEXT_ARCH[model_type]
    assert fields["general.architecture"].contents() == arch
    if model_type.startswith("qwen"):
        assert fields[f"{arch}.rope.dimension_sections"].contents() == [2, 3, 3, 0]
    if model_type == "qwen3_vl":
        assert fields["qwen3vl.n_deepstack_layers"].contents() == 1
