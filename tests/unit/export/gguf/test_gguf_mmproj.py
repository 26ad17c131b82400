"""GGUF + mmproj of image-text checkpoints: tiny random models written as a text GGUF plus llama.cpp's
mmproj, each read back with gguf-py and compared with the model (tests/vision_checks.py's checks, on
a few families here and on every one in tests/e2e/test_gguf_vision_families.py); the families
llama.cpp's converter writes otherwise are refused in one line. The Qwen and Pixtral conversions'
own transforms are test_gguf_mmproj_families.py's."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from vision_checks import check_mmproj_f32, check_text_gguf

from homelab_ft.export.gguf import arch as gguf_arch
from homelab_ft.export.gguf import check as gguf_check
from homelab_ft.export.gguf import mmproj, mmproj_check, text_view

UNIT_MMPROJ = ("gemma3", "qwen3_vl")
"""The mmproj read back here: Gemma 3's f16 input projection, Qwen3-VL's fused qkv (every family of
vision_checks.GGUF_FAMILIES in tests/e2e/test_gguf_vision_families.py)."""
UNIT_TEXT = ("idefics3", "qwen2_vl")
"""The text GGUF here: a Llama decoder, and Qwen2-VL's M-RoPE sections (every family in e2e)."""


@pytest.mark.parametrize("model_type", UNIT_MMPROJ)
def test_an_f32_mmproj_holds_the_vision_tower_exactly(vlm, model_type, tmp_path):
    check_mmproj_f32(vlm(model_type), model_type, tmp_path)


def test_q8_0_keeps_the_embeddings_f32_and_stays_within_its_bound(vlm, tmp_path):
    path = tmp_path / "mmproj-q8_0.gguf"
    mmproj.write_mmproj(vlm("idefics3"), path, gguf_type="q8_0", name="tiny")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["v.position_embd.weight"] == types["v.patch_embd.weight"] == "F32"
    assert types["v.blk.0.attn_q.weight"] == types["mm.model.fc.weight"] == "Q8_0"
    check = mmproj_check.verify_mmproj(path, vlm("idefics3"), gguf_type="q8_0")
    assert 0 < check.max_abs_diff <= check.bound


KEYS = {
    "idefics3": {"projector_type": "idefics3", "vision.preproc_image_size": 64, "vision.image_size": 32,
                 "vision.projector.scale_factor": 2},
    "gemma3": {"projector_type": "gemma3", "vision.projector.scale_factor": 2},
    "internvl": {"projector_type": "internvl", "vision.projector.scale_factor": 2},
    "qwen2_vl": {"projector_type": "qwen2vl_merger", "vision.image_size": 560, "vision.embedding_length": 32,
                 "vision.feed_forward_length": 128, "vision.spatial_merge_size": 2},
    "qwen2_5_vl": {"projector_type": "qwen2.5vl_merger", "vision.n_wa_pattern": 2, "use_silu": True},
    "qwen3_vl": {"projector_type": "qwen3vl_merger", "vision.image_size": 64, "use_gelu": True,
                 "vision.is_deepstack_layers": [True, False]},
    "mistral3": {"projector_type": "pixtral", "use_silu": True, "vision.spatial_merge_size": 2,
                 "vision.attention.layer_norm_epsilon": pytest.approx(1e-5)},
}
"""`clip.<key>` values llama.cpp reads, per family: SmolVLM's pixel shuffle (scale factor 2) and
preprocessing edge (2 tiles of 32 px); Gemma 3's pooling (4 x 4 patches to 2 x 2 tokens) and
InternVL's downsampling (0.5) as scale factors 2; Qwen2-VL's image size (the converter's 560: its
config has none) and widths from embed_dim (its vision hidden_size is the merger's output);
Qwen2.5-VL's windows (full attention every 2nd block); Qwen3-VL's image size from its 4 x 4 position
grid of 16 px patches, its deepstack tap on block 0; Pixtral's SiLU and merge."""


def test_the_keys_llama_cpp_reads(vlm, tmp_path):
    """KEYS, and for every family the text model's width as the projection and the tower's depth."""
    for model_type, want in KEYS.items():
        path = tmp_path / f"{model_type}.gguf"
        mmproj.write_mmproj(vlm(model_type), path, gguf_type="f16", name="tiny")
        fields = {k.removeprefix("clip."): v.contents() for k, v in gguf.GGUFReader(path).fields.items()}
        assert {key: fields.get(key) for key in want} == want, model_type
        assert fields["vision.projection_dim"] == 64 and fields["vision.block_count"] == 2


def test_a_tensor_written_wrong_fails_the_read_back(vlm, tmp_path, monkeypatch):
    path = tmp_path / "mmproj.gguf"
    real = mmproj.encode
    calls = []

    def one_off(array, qtype):
        calls.append(1)
        return real(array + np.float32(0.01) if len(calls) == 3 else array, qtype)

    monkeypatch.setattr(mmproj, "encode", one_off)
    mmproj.write_mmproj(vlm("internvl"), path, gguf_type="f32", name="tiny")
    with pytest.raises(RuntimeError, match="reads back different from what was meant"):
        mmproj_check.read_back(path, vlm("internvl"), gguf_type="f32")


def test_gemma3s_projector_norm_is_written_as_one_plus_w(vlm, tmp_path):
    """Gemma3RMSNorm computes x * (1 + w); clip.cpp's gemma3 graph multiplies by the stored weight."""
    from safetensors import safe_open

    path = tmp_path / "mmproj.gguf"
    mmproj.write_mmproj(vlm("gemma3"), path, gguf_type="f32", name="tiny")
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}["mm.soft_emb_norm.weight"]
    with safe_open(str(vlm("gemma3") / "model.safetensors"), "pt") as f:
        weight = f.get_tensor("multi_modal_projector.mm_soft_emb_norm.weight").float().numpy()
    np.testing.assert_array_equal(stored, weight + np.float32(1.0))


@pytest.mark.parametrize("model_type", UNIT_TEXT)
def test_the_text_gguf_is_the_language_model(vlm, model_type, tmp_path):
    check_text_gguf(vlm(model_type), model_type, tmp_path)


def test_a_typed_chat_template_is_probed_with_its_text(vlm, tmp_path):
    """Idefics3's template reads content parts (`message['content'][0]['type']`): a plain-string
    chat would render without its words, so the GGUF check probes it with text parts."""
    from transformers import AutoTokenizer

    view = text_view.write_text_view(vlm("idefics3"), tmp_path / "text")
    texts = gguf_check.probe_texts(AutoTokenizer.from_pretrained(view))
    assert "capital of France" in texts[0]


@pytest.mark.parametrize("model_type,overrides,refusal", [
    ("llava", {}, "registers no mmproj conversion for it that homelab-ft has read"),
    ("qwen3_vl_moe", {}, "`qwen3vlmoe`, whose fused experts"),
    ("qwen2_5_vl", {"window_size": 56}, r"window_size = 56, but llama.cpp b11739's qwen2.5vl window attention"),
    ("qwen2_5_vl", {"fullatt_block_indexes": [0, 2]}, r"\[0, 2\] is not every 1th block"),
    ("qwen2_vl", {"spatial_merge_size": 3}, "spatial_merge_size = 3"),
])
def test_families_whose_conversion_is_not_written_are_refused_in_one_line(model_type, overrides, refusal, tmp_path):
    """A family without a conversion here, and configs clip.cpp's graph would run as another model:
    llama.cpp b11739 sizes Qwen2.5-VL's windows as 112 px whatever clip.vision.window_size says
    (measured: a 56 px model's image embeddings 12% off in llama.cpp, with the key or without)."""
    from tiny_vlm import gguf_config

    gguf_config(model_type, **overrides).save_pretrained(tmp_path)
    config = text_view.image_text_config(tmp_path)
    with pytest.raises(gguf_arch.GgufUnsupported, match=refusal) as err:
        mmproj.projector_for(config)
    assert "\n" not in str(err.value)


def test_mmproj_types():
    assert [mmproj.mmproj_type(t) for t in ("f32", "f16", "bf16", "q8_0", "q5_1", "q4_0")] == [
        "f32", "f16", "bf16", "q8_0", "f16", "f16"]


def test_an_image_text_checkpoint_llama_cpp_has_no_conversion_for_is_refused_before_writing(tmp_path):
    """Llava (a CLIP tower): refused from its config alone (export/run.py then writes the safetensors
    asked beside the GGUF and gives this line)."""
    from tiny_vlm import gguf_config

    from homelab_ft.export.gguf import image_text

    gguf_config("llava").save_pretrained(tmp_path)
    with pytest.raises(gguf_arch.GgufUnsupported, match="LlavaForConditionalGeneration"):
        image_text.check_writable(tmp_path)
