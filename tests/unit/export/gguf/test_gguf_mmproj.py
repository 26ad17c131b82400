"""GGUF + mmproj of image-text checkpoints: tiny random Idefics3 (SmolVLM), Gemma 3, InternVL,
Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Mistral 3 models written as a text GGUF plus llama.cpp's mmproj,
each read back with gguf-py and compared with the model; the families llama.cpp's converter writes
otherwise are refused in one line. The Qwen and Pixtral conversions' own transforms are
test_gguf_mmproj_families.py's."""

from __future__ import annotations

import json

import build_recipe
import gguf
import numpy as np
import pytest
import torch

from homelab_ft.export.gguf import arch as gguf_arch
from homelab_ft.export.gguf import check as gguf_check
from homelab_ft.export.gguf import export as gguf_export
from homelab_ft.export.gguf import mmproj, mmproj_check, text_view

FAMILIES = ("idefics3", "gemma3", "internvl", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "mistral3")

TEXT_ARCH = {"idefics3": "llama", "gemma3": "gemma3", "internvl": "qwen2", "qwen2_vl": "qwen2vl",
             "qwen2_5_vl": "qwen2vl", "qwen3_vl": "qwen3vl", "mistral3": "llama"}
"""The architecture llama.cpp's converter writes each family's language model as (Mistral 3's:
`llama`, as any Mistral decoder, where the converter writes `mistral3`; docs/export.md)."""


@pytest.mark.parametrize("model_type", (*FAMILIES, "smolvlm"))
def test_an_f32_mmproj_holds_the_vision_tower_exactly(vlm, model_type, tmp_path):
    """Every vision-side tensor in the file bit for bit, and the features of the tower loaded back
    from it equal the model's (Gemma 3's input projection is f16 as llama.cpp's converter keeps it)."""
    path = tmp_path / "mmproj-f32.gguf"
    plan = mmproj.write_mmproj(vlm(model_type), path, gguf_type="f32", name="tiny")
    check = mmproj_check.verify_mmproj(path, vlm(model_type), gguf_type="f32")
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


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_text_gguf_is_the_language_model(vlm, model_type, tmp_path):
    """The language model laid out as its causal LM (Qwen-VL's as its Qwen2 / Qwen3 twin) gives the
    image-text model's text-only logits, and its GGUF, in the architecture llama.cpp runs it as
    (Qwen-VL's with its M-RoPE sections, Qwen3-VL's with its deepstack count), passes the text
    export's own check (tensors, tokenizer, logits)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    view = text_view.write_text_view(vlm(model_type), tmp_path / "text")
    ids = torch.tensor([[1, 5, 9, 14, 30, 2]])
    with torch.no_grad():
        want = AutoModelForImageTextToText.from_pretrained(vlm(model_type), dtype=torch.float32)(input_ids=ids).logits
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
    from tiny_vlm import tiny_vlm_config

    tiny_vlm_config(model_type, **overrides).save_pretrained(tmp_path)
    config = text_view.image_text_config(tmp_path)
    with pytest.raises(gguf_arch.GgufUnsupported, match=refusal) as err:
        mmproj.projector_for(config)
    assert "\n" not in str(err.value)


def test_mmproj_types():
    assert [mmproj.mmproj_type(t) for t in ("f32", "f16", "bf16", "q8_0", "q5_1", "q4_0")] == [
        "f32", "f16", "bf16", "q8_0", "f16", "f16"]


def test_export_of_an_image_text_run_writes_the_text_gguf_and_its_mmproj(vlm, tmp_path, capsys):
    """`homelab-ft export --format gguf` of a Gemma 3 LoRA run: the merged language model as a
    gemma3 GGUF, the (untrained) vision tower as its mmproj, both checked, RUNNING.md giving llama.cpp
    both files and no Modelfile (Ollama does not load the pair)."""

    from homelab_ft.cli.main import main
    from homelab_ft.export.local_runtimes import unknown_llama_cpp_flags

    # transformers' causal-LM class for Gemma 3 is its image-text class: main trains the language model
    run = build_recipe.lora_run(tmp_path, vlm("gemma3"), targets=r".*language_model.*\.(q_proj|v_proj)")
    out = tmp_path / "gguf"
    assert main(["export", str(run), "--out", str(out), "--format", "gguf", "--gguf-type", "f32"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["RUNNING.md", "homelab_ft_export.json", "mmproj-f32.gguf",
                                                     "model-f32.gguf"]
    meta = json.loads((out / "homelab_ft_export.json").read_text())
    assert meta["gguf"]["max_abs_diff"] < 1e-4
    assert meta["gguf"]["mmproj"]["projector"] == "gemma3" and meta["gguf"]["mmproj"]["max_abs_diff"] <= meta["gguf"]["mmproj"]["bound"]
    assert gguf.GGUFReader(out / "model-f32.gguf").fields["general.architecture"].contents() == "gemma3"
    running = (out / "RUNNING.md").read_text()
    assert f"llama-mtmd-cli -m {out.name}/model-f32.gguf --mmproj {out.name}/mmproj-f32.gguf --image" in running
    assert unknown_llama_cpp_flags(running) == []
    assert "mmproj check" in capsys.readouterr().out


def test_an_image_text_checkpoint_llama_cpp_has_no_conversion_for_is_refused_before_writing(tmp_path):
    """Llava (a CLIP tower): refused from its config alone (export/run.py then writes the safetensors
    asked beside the GGUF and gives this line)."""
    from tiny_vlm import tiny_vlm_config

    from homelab_ft.export.gguf import image_text

    tiny_vlm_config("llava").save_pretrained(tmp_path)
    with pytest.raises(gguf_arch.GgufUnsupported, match="LlavaForConditionalGeneration"):
        image_text.check_writable(tmp_path)
