"""A GGUF + mmproj export run by llama.cpp's own multimodal library (libmtmd, b11739) beside
transformers on the model it came from. Skipped, with the reason, where no Python with that library
is configured (HOMELAB_FT_LLAMA_MTMD_PYTHON; tools/llama_mtmd_env.py makes one).

Tiny models whose weights are drawn wide (std 0.2, text and vision): with the default 0.02 the
attention of a tiny tower is near uniform, so a rope or window written wrong barely shows (Pixtral's
unpermuted q/k: 60% off at 0.2)."""

from __future__ import annotations

import pytest

from homelab_ft.export.gguf import export as gguf_export
from homelab_ft.export.gguf import mmproj, text_view

llama_mtmd = pytest.importorskip("llama_mtmd")
PYTHON, WHAT = llama_mtmd.runtime()
pytestmark = pytest.mark.skipif(PYTHON is None, reason=WHAT)


def _export(model_dir, out, *, gguf_type: str):
    view = text_view.write_text_view(model_dir, out / "text")
    gguf_export.write_gguf(view, out / "model.gguf", gguf_type=gguf_type, name="tiny")
    mmproj.write_mmproj(model_dir, out / "mmproj.gguf", gguf_type=gguf_type, name="tiny")
    return out / "model.gguf", out / "mmproj.gguf"


def test_smolvlm_describes_an_image_with_transformers_greedy_tokens(tmp_path):
    """The issue's must-show, on a tiny Idefics3 (SmolVLM v1's class) whose text weights are drawn
    wide enough (std 0.2) that its greedy reply is not one token repeated: llama.cpp tokenizes the
    prompt with the image's tiles where transformers' processor puts them, its image embeddings
    match transformers' features, and its 12 greedy tokens are transformers'."""
    from tiny_vlm import quadrants_image, save_gguf_vlm

    model_dir = save_gguf_vlm(tmp_path / "model", "idefics3", text_overrides={"initializer_range": 0.2})
    gguf, projector = _export(model_dir, tmp_path, gguf_type="f32")
    side = llama_mtmd.compare(model_dir, gguf, projector, quadrants_image(tmp_path / "image.png"), python=PYTHON)
    assert side.llama_prompt == side.hf_prompt
    assert side.max_embedding_diff < 1e-2 * float(side.hf_embeddings.abs().max())
    assert len(set(side.hf_greedy)) > 3
    assert side.llama_greedy == side.hf_greedy


WIDE = {"text_overrides": {"initializer_range": 0.2}, "initializer_range": 0.2}

@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "mistral3"])
def test_qwen_vl_and_mistral_3_answer_an_image_with_transformers_greedy_tokens(model_type, tmp_path):
    """Each family's GGUF + mmproj in llama.cpp on a noise image (every window and patch differs):
    the same prompt (the image's chunk where transformers' image tokens are: Qwen's between
    <|vision_start|> and <|vision_end|>, Pixtral's rows with their [IMG_BREAK] embedding), image
    embeddings within 2e-3 of their largest (Qwen3-VL's with its deepstack features beside), and the
    same 12 greedy tokens, which for Qwen follow M-RoPE's image positions (transformers' own reply
    without them departs at the third token)."""
    from tiny_vlm import EXACT_SIDES, save_gguf_vlm

    from homelab_ft.export.gguf.mmproj_check import probe_image

    model_dir = save_gguf_vlm(tmp_path / "model", model_type, **WIDE)
    gguf, projector = _export(model_dir, tmp_path, gguf_type="f32")
    probe_image(EXACT_SIDES[model_type]).save(tmp_path / "image.png")
    side = llama_mtmd.compare(model_dir, gguf, projector, tmp_path / "image.png", python=PYTHON)
    assert side.llama_prompt == side.hf_prompt
    assert side.max_embedding_diff < 2e-3 * float(side.hf_embeddings.abs().max())
    assert len(set(side.hf_greedy)) > 3
    assert side.llama_greedy == side.hf_greedy


def test_a_large_image_is_sized_as_in_training_with_the_bounds_running_md_gives(tmp_path):
    """A 560 x 560 image on a Qwen2-VL whose processor allows 8-256 tokens: transformers resizes it
    to 16 x 16 tokens; llama.cpp's own bounds (8-4096) keep 20 x 20, another prompt and reply; with
    RUNNING.md's --image-min-tokens / --image-max-tokens (image_text.image_tokens) the same prompt
    and greedy tokens."""
    from tiny_vlm import save_gguf_vlm

    from homelab_ft.export.gguf import image_text
    from homelab_ft.export.gguf.mmproj_check import probe_image

    model_dir = save_gguf_vlm(tmp_path / "model", "qwen2_vl", **WIDE)
    gguf, projector = _export(model_dir, tmp_path, gguf_type="f32")
    probe_image(560).save(tmp_path / "image.png")
    bounds = image_text.image_tokens(mmproj.plan_mmproj(model_dir, gguf_type="f32"), model_dir, pixels=(None, None))
    own = llama_mtmd.compare(model_dir, gguf, projector, tmp_path / "image.png", python=PYTHON)
    assert own.hf_prompt.count(-1) == 256 and own.llama_prompt.count(-1) == 400
    sized = llama_mtmd.compare(model_dir, gguf, projector, tmp_path / "image.png", python=PYTHON, image_tokens=bounds)
    assert sized.llama_prompt == sized.hf_prompt
    assert sized.llama_greedy == sized.hf_greedy


def test_an_image_text_adapter_gguf_on_its_base_answers_as_the_merged_model(tmp_path):
    """A LoRA on Qwen2-VL's language model as llama.cpp's adapter GGUF, applied to the base's text
    GGUF with the base's mmproj: llama.cpp's 12 greedy tokens on an image are transformers' on the
    merged model (and not the base's)."""
    import shutil

    import torch
    from peft import LoraConfig, get_peft_model
    from tiny_vlm import EXACT_SIDES, save_gguf_vlm
    from transformers import AutoModelForImageTextToText

    from homelab_ft.export.gguf.adapter import write_adapter_gguf
    from homelab_ft.export.gguf.mmproj_check import probe_image

    base = save_gguf_vlm(tmp_path / "base", "qwen2_vl", **WIDE)
    torch.manual_seed(1)
    peft = get_peft_model(AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32), LoraConfig(
        r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|down_proj)"))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    peft.save_pretrained(tmp_path / "adapter")
    write_adapter_gguf(tmp_path / "adapter", base, tmp_path / "adapter.gguf", name="tiny")
    merged = tmp_path / "merged"
    peft.merge_and_unload().save_pretrained(merged)
    for file in base.iterdir():
        if not (merged / file.name).exists():
            shutil.copyfile(file, merged / file.name)
    gguf, projector = _export(base, tmp_path, gguf_type="f32")
    probe_image(EXACT_SIDES["qwen2_vl"]).save(tmp_path / "image.png")
    side = llama_mtmd.compare(merged, gguf, projector, tmp_path / "image.png", python=PYTHON, lora=tmp_path / "adapter.gguf")
    assert side.llama_greedy == side.hf_greedy
    base_side = llama_mtmd.compare(base, gguf, projector, tmp_path / "image.png", python=PYTHON)
    assert base_side.hf_greedy[:4] != side.hf_greedy[:4]


@pytest.mark.parametrize("model_type", ["gemma3", "internvl"])
def test_llama_cpps_image_embeddings_are_transformers_features(model_type, tmp_path):
    """Gemma 3 and InternVL at the tower's own image size (no resampling on either side): what the
    language model receives for the image, as llama.cpp computes it from the mmproj, is what
    transformers computes (Gemma 3's input projection is f16 in the file, as llama.cpp keeps it; InternVL's
    position table has its class-token row last, as llama.cpp's graph reads it: 9% off otherwise)."""
    from tiny_vlm import IMAGE, quadrants_image, save_gguf_vlm

    model_dir = save_gguf_vlm(tmp_path / "model", model_type)
    gguf, projector = _export(model_dir, tmp_path, gguf_type="f32")
    hf, llama = llama_mtmd.compare_embeddings(model_dir, gguf, projector, quadrants_image(tmp_path / "i.png", size=IMAGE),
                                              python=PYTHON)
    assert hf.shape == llama.shape
    assert float((hf - llama).abs().max()) < 2e-3 * float(hf.abs().max())
