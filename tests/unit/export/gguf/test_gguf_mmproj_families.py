"""The Qwen-VL and Pixtral conversions' own transforms, on tiny random Qwen2-VL, Qwen3-VL and
Mistral 3 checkpoints: the tensors llama.cpp's converter splits, permutes or copies out of the
language model, each against the checkpoint; and the LoRA GGUF of an image-text model's language
model (what llama.cpp then computes with them: test_gguf_mmproj_llama_cpp.py)."""

from __future__ import annotations

from pathlib import Path

import build_recipe
import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from homelab_ft.errors import UserError
from homelab_ft.export.gguf import arch as gguf_arch
from homelab_ft.export.gguf import mmproj
from homelab_ft.export.gguf.adapter import check_adapter_gguf, write_adapter_gguf


def _stored(path: Path) -> dict[str, np.ndarray]:
    return {t.name: np.array(t.data).reshape([int(d) for d in reversed(t.shape)]) for t in gguf.GGUFReader(path).tensors}


def _checkpoint(model_dir: Path) -> dict[str, np.ndarray]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name).float().numpy() for name in f.keys()}


def test_qwen2_vl_splits_fused_qkv_and_the_conv3d_kernel_as_llama_cpp_reads_them(vlm, tmp_path):
    """Qwen2VLVisionModel's splits: attn.qkv's rows in thirds (q, k, v), the Conv3d patch kernel's
    two time steps as v.patch_embd.weight and v.patch_embd.weight.1 (the graph adds the two
    convolutions of a still image, which transformers feeds twice)."""
    path = tmp_path / "mmproj.gguf"
    mmproj.write_mmproj(vlm("qwen2_vl"), path, gguf_type="f32", name="tiny")
    stored, weights = _stored(path), _checkpoint(vlm("qwen2_vl"))
    key = next(k for k in weights if k.endswith("blocks.0.attn.qkv.weight"))
    q, k, v = np.split(weights[key], 3)
    for part, want in (("q", q), ("k", k), ("v", v)):
        np.testing.assert_array_equal(stored[f"v.blk.0.attn_{part}.weight"], want)
    kernel = weights[next(k for k in weights if k.endswith("patch_embed.proj.weight"))]
    np.testing.assert_array_equal(stored["v.patch_embd.weight"], kernel[:, :, 0])
    np.testing.assert_array_equal(stored["v.patch_embd.weight.1"], kernel[:, :, 1])


def test_qwen3_vl_numbers_its_deepstack_mergers_by_the_block_they_tap(vlm, tmp_path):
    """deepstack_merger_list.0 taps block deepstack_visual_indexes[0]: written as v.deepstack.<block>
    (the converter's absolute index, which clip.vision.is_deepstack_layers marks); q/k/v stay fused."""
    from tiny_vlm import save_gguf_vlm

    model_dir = save_gguf_vlm(tmp_path / "model", "qwen3_vl", deepstack_visual_indexes=[1])
    path = tmp_path / "mmproj.gguf"
    mmproj.write_mmproj(model_dir, path, gguf_type="f32", name="tiny")
    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    assert {"v.deepstack.1.fc1.weight", "v.deepstack.1.norm.weight", "v.blk.1.attn_qkv.weight"} <= names
    assert not any(name.startswith("v.deepstack.0.") for name in names)
    assert reader.fields["clip.vision.is_deepstack_layers"].contents() == [False, True]


def test_pixtral_permutes_q_and_k_and_carries_the_img_break_embedding(vlm, tmp_path):
    """LlavaVisionModel's Pixtral: q/k rows permuted per head (llama.cpp ropes interleaved pairs, as
    for a llama text model), and the language model's [IMG_BREAK] embedding row as
    v.token_embd.img_break, which the graph puts after each row of patches."""
    from transformers import AutoTokenizer

    path = tmp_path / "mmproj.gguf"
    mmproj.write_mmproj(vlm("mistral3"), path, gguf_type="f32", name="tiny")
    stored, weights = _stored(path), _checkpoint(vlm("mistral3"))
    q = weights[next(k for k in weights if k.endswith("layers.0.attention.q_proj.weight"))]
    np.testing.assert_array_equal(stored["v.blk.0.attn_q.weight"], gguf_arch.permute_heads(q, 2))
    assert not np.array_equal(stored["v.blk.0.attn_q.weight"], q)
    table = weights[next(k for k in weights if k.endswith("embed_tokens.weight"))]
    row = AutoTokenizer.from_pretrained(vlm("mistral3")).convert_tokens_to_ids("[IMG_BREAK]")
    np.testing.assert_array_equal(stored["v.token_embd.img_break"], table[row])


def test_the_image_tokens_of_training_are_the_processors_bounds_as_the_run_set_them(vlm, tmp_path):
    """Qwen2-VL's tiny processor sizes images into 8-256 merged tokens of 28 x 28 px; a run that
    resized its images into 10,000-100,000 px, and gave its processor those bounds, trained on 13-127
    tokens (127.55 rounded down, 12.76 up: inside both bounds); one with a 400,000 px bound raised the
    processor's cap to 510 tokens, and one with only a floor kept the cap; Pixtral, whose
    longest-edge rule llama.cpp sizes otherwise, has none."""
    from homelab_ft.export.gguf import image_text

    written = image_text.write_mmproj(vlm("qwen2_vl"), tmp_path, gguf_type="f32", name="tiny", base_dir=vlm("qwen2_vl"))
    assert written.image_tokens == (8, 256)
    plan = mmproj.plan_mmproj(vlm("qwen2_vl"), gguf_type="f32")
    assert image_text.image_tokens(plan, vlm("qwen2_vl"), pixels=(10_000, 100_000)) == (13, 127)
    assert image_text.image_tokens(plan, vlm("qwen2_vl"), pixels=(None, 400_000)) == (8, 510)
    assert image_text.image_tokens(plan, vlm("qwen2_vl"), pixels=(1_000, None)) == (2, 256)
    pixtral = mmproj.plan_mmproj(vlm("mistral3"), gguf_type="f32")
    assert image_text.image_tokens(pixtral, vlm("mistral3"), pixels=(None, None)) is None


def test_a_pixtral_tower_llama_cpp_runs_otherwise_is_refused(tmp_path):
    """llama.cpp's pixtral graph reads the tower's last layer and fixes its rope base at 10000."""
    from tiny_vlm import gguf_config

    from homelab_ft.export.gguf import text_view

    config = gguf_config("mistral3")
    config.vision_feature_layer = -2
    config.save_pretrained(tmp_path)
    with pytest.raises(gguf_arch.GgufUnsupported, match="vision_feature_layer = -2"):
        mmproj.projector_for(text_view.image_text_config(tmp_path))


def _adapter(model_dir: Path, out: Path, target_modules: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(1)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, init_lora_weights=False))
    peft.save_pretrained(out)
    return peft


def test_the_adapter_gguf_of_an_image_text_model_is_its_language_models(vlm, tmp_path):
    """A LoRA on Qwen2-VL's language model: named as its text GGUF's tensors, under `qwen2vl` (llama.cpp
    loads an adapter only onto a base of its architecture), alpha / r * B @ A equal to PEFT's delta."""
    peft = _adapter(vlm("qwen2_vl"), tmp_path / "adapter", r".*language_model.*\.(q_proj|v_proj)")
    write_adapter_gguf(tmp_path / "adapter", vlm("qwen2_vl"), tmp_path / "adapter.gguf", name="tiny")
    assert check_adapter_gguf(tmp_path / "adapter.gguf", peft, vlm("qwen2_vl")) <= 1e-5
    reader = gguf.GGUFReader(tmp_path / "adapter.gguf")
    assert reader.fields["general.architecture"].contents() == "qwen2vl"
    assert {t.name for t in reader.tensors} >= {"blk.0.attn_q.weight.lora_a", "blk.3.attn_v.weight.lora_b"}


@pytest.mark.parametrize("model_type,targets,refusal", [
    ("qwen2_vl", r".*visual.*\.qkv", "outside the language model"),
    ("mistral3", r".*language_model.*\.q_proj", "as 'mistral3', homelab-ft as a Mistral decoder"),
])
def test_an_adapter_llama_cpp_cannot_apply_is_refused_in_one_line(vlm, model_type, targets, refusal, tmp_path):
    """LoRA on the vision tower (the mmproj takes none), and Mistral 3, whose language model llama.cpp's
    converter writes as `mistral3` where homelab-ft writes `llama`: no base GGUF takes both."""
    _adapter(vlm(model_type), tmp_path / "adapter", targets)
    with pytest.raises(UserError, match=refusal) as err:
        write_adapter_gguf(tmp_path / "adapter", vlm(model_type), tmp_path / "adapter.gguf", name="tiny")
    assert "\n" not in str(err.value)


def test_adapter_only_export_of_an_image_text_run_runs_on_the_bases_pair(vlm, tmp_path):
    """`homelab-ft export --adapter-only --format gguf` of a Gemma 3 LoRA run: adapter.gguf under
    `gemma3`, checked against PEFT, and a RUNNING.md loading it with the base's text GGUF and mmproj."""

    from homelab_ft.cli.main import main
    from homelab_ft.export.local_runtimes import unknown_llama_cpp_flags

    run = build_recipe.lora_run(tmp_path, vlm("gemma3"), targets=r".*language_model.*\.(q_proj|v_proj)")
    out = tmp_path / "adapter"
    assert main(["export", str(run), "--out", str(out), "--adapter-only", "--format", "gguf"]) == 0
    assert gguf.GGUFReader(out / "adapter.gguf").fields["general.architecture"].contents() == "gemma3"
    running = (out / "RUNNING.md").read_text()
    assert "--mmproj" in running and f"--lora {out.name}/adapter.gguf" in running
    assert unknown_llama_cpp_flags(running) == []
