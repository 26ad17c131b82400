"""GGUF + mmproj of every image-text family homelab-ft writes (tests/vision_checks.GGUF_FAMILIES), the
checks tests/unit/export/gguf/test_gguf_mmproj.py runs on a few: each f32 mmproj read back bit for
bit with the tower's features equal to the model's, and each language model's text GGUF in the
architecture llama.cpp runs it as, passing the text export's check; and the export of a Gemma 3 LoRA
run as the pair. ~10 CPU s."""

from __future__ import annotations

import json

import build_recipe
import gguf
import pytest
from vision_checks import GGUF_FAMILIES, TEXT_ARCH, check_mmproj_f32, check_text_gguf


@pytest.mark.parametrize("model_type", GGUF_FAMILIES)
def test_an_f32_mmproj_holds_the_vision_tower_exactly(vlm, model_type, tmp_path):
    check_mmproj_f32(vlm(model_type), model_type, tmp_path)


@pytest.mark.parametrize("model_type", tuple(TEXT_ARCH))
def test_the_text_gguf_is_the_language_model(vlm, model_type, tmp_path):
    check_text_gguf(vlm(model_type), model_type, tmp_path)


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
