"""A GGUF + mmproj export run by llama.cpp's own multimodal library (libmtmd, b11739) beside
transformers on the model it came from. Skipped, with the reason, where no Python with that library
is configured (HOMELAB_FT_LLAMA_MTMD_PYTHON; tools/llama_mtmd_env.py makes one)."""

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
    from tiny_vlm import quadrants_image, save_tiny_vlm

    model_dir = save_tiny_vlm(tmp_path / "model", "idefics3", text_overrides={"initializer_range": 0.2})
    gguf, projector = _export(model_dir, tmp_path, gguf_type="f32")
    side = llama_mtmd.compare(model_dir, gguf, projector, quadrants_image(tmp_path / "image.png"), python=PYTHON)
    assert side.llama_prompt == side.hf_prompt
    assert side.max_embedding_diff < 1e-2 * float(side.hf_embeddings.abs().max())
    assert len(set(side.hf_greedy)) > 3
    assert side.llama_greedy == side.hf_greedy


@pytest.mark.parametrize("model_type", ["gemma3", "internvl"])
def test_llama_cpps_image_embeddings_are_transformers_features(model_type, tmp_path):
    """Gemma 3 and InternVL at the tower's own image size (no resampling on either side): what the
    language model receives for the image, as llama.cpp computes it from the mmproj, is what
    transformers computes (Gemma 3's input projection is f16 in the file, as llama.cpp keeps it; InternVL's
    position table has its class-token row last, as llama.cpp's graph reads it: 9% off otherwise)."""
    from tiny_vlm import IMAGE, quadrants_image, save_tiny_vlm

    model_dir = save_tiny_vlm(tmp_path / "model", model_type)
    gguf, projector = _export(model_dir, tmp_path, gguf_type="f32")
    hf, llama = llama_mtmd.compare_embeddings(model_dir, gguf, projector, quadrants_image(tmp_path / "i.png", size=IMAGE),
                                              python=PYTHON)
    assert hf.shape == llama.shape
    assert float((hf - llama).abs().max()) < 2e-3 * float(hf.abs().max())
