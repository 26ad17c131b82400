"""Image rows end to end (issue 35) on tiny random checkpoints of several image-text families
(tests/tiny_vlm.py): plan, train 2 LoRA steps on images, export the merged model with its
processor files, and reload it as a user does (`AutoModelForImageTextToText` + the processor) with
logits within 1e-5 of the trained model's (base + adapter) on an image."""

from __future__ import annotations

import json
from pathlib import Path

import build_recipe
import pytest
import torch
from tiny_vlm import image_chat, make_image, save_vlm

from homelab_ft.cli.main import main

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "llava", "llava_next", "idefics3", "internvl", "gemma3")
"""Every family the data pipeline reads images for here (tiny_vlm.TRAINED), through `plan` and `train`:
the Qwen-VL ones, which transformers builds no causal LM for, and Qwen 3.5, whose causal-LM class is
its text decoder alone (the image run's plan and model are its image-text class, tower included)."""

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30)}


def write_rows(folder: Path, num_rows: int = 12) -> Path:
    """Rows asking the colour of a solid image, answered by its name; images of two shapes."""
    rows = []
    for i in range(num_rows):
        name = list(COLOURS)[i % len(COLOURS)]
        image = make_image(folder / "img" / f"{name}-{i % 2}.png", size=(60, 40) if i % 2 else (40, 70),
                           colour=COLOURS[name])
        rows.append(image_chat(str(image.relative_to(folder)), answer=name))
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def image_recipe(folder: Path, model_dir: Path, **sections) -> Path:
    rows = write_rows(folder)
    return build_recipe.write_recipe(folder / "r.yaml", build_recipe.tiny_run(
        model_dir, rows=rows.name, **build_recipe.merged(
            {"data": {"images": True, "max_length": 256, "cache_dir": str(folder / "cache"), "eval_fraction": 0.25},
             "train": {"max_steps": 2, "lr": 1e-2}}, sections)))


def probe(processor, image_path: Path) -> dict:
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return dict(processor(text=[text], images=[[Image.open(image_path).convert("RGB")]], return_tensors="pt"))


def trained_and_exported_logits(run: Path, out: Path, model_dir: Path, image: Path):
    """(trained: the base + the run's newest adapter, exported: AutoModelForImageTextToText from the
    export, base: the base alone) logits on `image`, each read by its own folder's processor."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from homelab_ft.export import merged
    from homelab_ft.model.processor import load_processor
    from homelab_ft.store.layout import RunDir

    layout = RunDir(run)
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    recipe = layout.read_recipe()
    inputs = probe(load_processor(model_dir, AutoConfig.from_pretrained(model_dir)), image)
    assert all(torch.equal(v, inputs[k]) for k, v in probe(load_processor(out, AutoConfig.from_pretrained(out)),
                                                            image).items())  # the exported processor reads alike
    with torch.no_grad():
        trained = merged.load_base_with_adapter(ckpt, model_dir, recipe, images=True).eval()(**inputs).logits
        exported = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()(**inputs).logits
        base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()(**inputs).logits
    return trained, exported, base


@pytest.mark.parametrize("model_type", FAMILIES)
def test_lora_on_images_plans_trains_exports_and_reloads_with_the_trained_logits(model_type, tmp_path, capsys):
    model_dir = save_vlm(tmp_path / model_type, model_type)
    recipe = image_recipe(tmp_path, model_dir)
    assert main(["plan", str(recipe)]) == 0
    run, out = tmp_path / "run", tmp_path / "out"
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 0
    from homelab_ft.store.layout import RunDir

    rung = RunDir(run).read_info().rung
    assert rung.images and rung.adapters_enabled and not rung.quantized_enabled
    planned = json.loads((run / "plan.json").read_text())  # `train` planned the image run: tower and images
    assert planned["chosen"]["memory"]["vision_forward"] > 0 and planned["request"]["images"]["tokens_per_image"] > 0
    from homelab_ft.train.metrics import read_metrics

    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "eval_loss" in r] == [2]  # held-out images
    assert main(["export", str(run), "--out", str(out), "--format", "safetensors"]) == 0
    assert "AutoModelForImageTextToText" in (out / "RUNNING.md").read_text()
    trained, exported, base = trained_and_exported_logits(run, out, model_dir, tmp_path / "img" / "red-0.png")
    assert (trained - exported).abs().max() <= 1e-5
    assert (trained - base).abs().max() > 1e-3  # the two steps changed the model
    from transformers import AutoConfig

    from homelab_ft.model.processor import load_processor  # AutoProcessor, its video side left out here

    config = AutoConfig.from_pretrained(model_dir)
    assert type(load_processor(out, config)).__name__ == type(load_processor(model_dir, config)).__name__


def test_qlora_on_images_keeps_the_tower_in_16_bit_and_exports(tmp_path):
    """bitsandbytes quantizes the language model only on an image run (rules/vision.quant_skip)."""
    from homelab_ft.distributed import comm
    from homelab_ft.recipe.config import load_recipe
    from homelab_ft.rules import vision
    from homelab_ft.rung import rung_for
    from homelab_ft.train import build

    model_dir = save_vlm(tmp_path / "llava", "llava")
    recipe_path = image_recipe(tmp_path, model_dir, method="qlora")
    recipe = load_recipe(recipe_path)
    model = build.load_whole(recipe, model_dir=model_dir, rung=rung_for(recipe), device=torch.device("cpu"),
                             dtype=torch.float32)
    prefixes = vision.vision_prefixes(model)
    kinds = {(vision.is_vision_module(n, prefixes), type(m).__name__) for n, m in model.named_modules()
             if type(m).__name__ in ("Linear", "Linear4bit")}
    assert (True, "Linear") in kinds and (False, "Linear4bit") in kinds
    assert (True, "Linear4bit") not in kinds and comm.device_type("cpu") == "cpu"
    run, out = tmp_path / "run", tmp_path / "out"
    assert main(["train", str(recipe_path), "--run-dir", str(run)]) == 0
    assert main(["export", str(run), "--out", str(out), "--format", "safetensors"]) == 0
    trained, exported, _ = trained_and_exported_logits(run, out, model_dir, tmp_path / "img" / "red-0.png")
    assert (trained - exported).abs().max() <= 1e-5  # both on the full-precision base: the merge is exact


def test_a_full_finetune_on_images_trains_the_language_model_and_what_the_recipe_lists(tmp_path):
    """method: full freezes the vision side but the layers lora.target_modules names (here the
    projector); the export holds the tower as it was and reloads to the trained model's logits."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from homelab_ft.export.consolidate import load_weights
    from homelab_ft.model.processor import load_processor

    model_dir = save_vlm(tmp_path / "llava", "llava")
    recipe = image_recipe(tmp_path, model_dir, method="full", lora={"target_modules": ["multi_modal_projector.linear_1"]})
    run, out = tmp_path / "run", tmp_path / "out"
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 0
    assert main(["export", str(run), "--out", str(out), "--format", "safetensors"]) == 0
    base, trained = load_file(model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    changed = {k for k in base if not torch.equal(base[k], trained[k])}  # Llava's saved layout: language_model.*
    assert any(k.startswith("language_model.") for k in changed)
    assert {k for k in changed if not k.startswith("language_model.")} == {
        "multi_modal_projector.linear_1.weight", "multi_modal_projector.linear_1.bias"}
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    in_memory = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    load_weights(ckpt / "state", in_memory)  # what `homelab-ft chat` talks to
    inputs = probe(load_processor(out, in_memory.config), tmp_path / "img" / "blue-1.png")
    with torch.no_grad():
        expected = in_memory.eval()(**inputs).logits
        got = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()(**inputs).logits
    assert (expected - got).abs().max() <= 1e-5


def test_chat_and_generate_take_an_image_and_give_the_same_reply(tmp_path, tiny_model_dir, capsys):
    """`chat RUN --image` (adapter applied in memory) and `generate EXPORT --image` reply alike; a
    text model and a text run refuse --image in one line."""
    model_dir = save_vlm(tmp_path / "idefics3", "idefics3")
    recipe = image_recipe(tmp_path, model_dir)
    run, out = tmp_path / "run", tmp_path / "out"
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 0
    assert main(["export", str(run), "--out", str(out), "--format", "safetensors"]) == 0
    capsys.readouterr()
    image = str(tmp_path / "img" / "green-0.png")
    ask = ["--image", image, "--prompt", "what colour?", "--max-new-tokens", "6"]
    assert main(["chat", str(run), *ask]) == 0
    in_memory = capsys.readouterr().out
    assert main(["generate", str(out), *ask]) == 0
    assert capsys.readouterr().out == in_memory and in_memory.strip()
    assert main(["generate", str(tiny_model_dir), *ask]) == 2
    assert f"--image: {tiny_model_dir} is a text model" in capsys.readouterr().err
    text_run = tmp_path / "text-run"
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                   {"role": "assistant", "content": "yes"}]}) + "\n")
    text_recipe = build_recipe.write_recipe(tmp_path / "t.yaml", build_recipe.tiny_run(
        model_dir, rows="chat.jsonl", data={"cache_dir": str(tmp_path / "cache")}, train={"max_steps": 1,
                                                                                          "micro_batch_size": 1}))
    assert main(["train", str(text_recipe), "--run-dir", str(text_run)]) == 0
    capsys.readouterr()
    assert main(["chat", str(text_run), *ask]) == 2
    assert "trained on text rows (data.images: false)" in capsys.readouterr().err
