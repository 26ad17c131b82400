"""The planner against the trainer's measured CPU peak for a batch of image rows (issue 35: within
15% on two families): one LoRA step of an image-text model, Qwen2-VL (image tokens that grow with
the image, M-RoPE) and Idefics3 (SmolVLM's architecture: tiles of a fixed count), each micro-batch
two rows of 1024 tokens carrying images, all of it through the CLI: `data inspect` prepares the rows
and keeps their images and image tokens, `homelab-ft train` plans with them (plan.json) and trains,
its second step metered in a fresh process (vision_step_peak.py, bench/memory.py's peak; one process
runs the three cases one after another). Compared:
what plan.json says the step adds to the weights and optimizer state (bench/memory.planned_step:
memory.total - overhead - weights - optimizer) and the measured peak of that step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from build_recipe import tiny_run, write_recipe
from tiny_vlm import image_chat, make_image, save_vlm

ROOT = Path(__file__).resolve().parents[2]

TEXT = {"hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
        "max_position_embeddings": 2048}
VISION = {"hidden_size": 256, "embed_dim": 256, "intermediate_size": 1024, "num_attention_heads": 4, "num_heads": 4,
          "depth": 4, "num_hidden_layers": 4, "head_dim": 64}
CASES = {
    # name: (family, images per row, side in px, LoRA targets beyond all-linear): Qwen2-VL spends 64 tokens
    # on a 224 px image, 256 on a 448 px one (data.image_max_pixels raising its processor's 16-token cap);
    # Idefics3 10 tiles of 4 tokens on any image (3 x 3 tiles of its 96 px longest edge and the whole image)
    "qwen2_vl": ("qwen2_vl", 3, 224, ()),
    "idefics3": ("idefics3", 4, 192, ()),
    # adapters in the tower too (its attention and MLP layers, `qkv` `proj` `fc1` `fc2`): it keeps what it
    # saves for backward beside the language model's activations, 6,144 patches of it per micro-batch
    "qwen2_vl tower": ("qwen2_vl", 3, 448, ("qkv", "attn.proj", "fc1", "fc2")),
}
ROWS, SEQ = 2, 1024
ANSWER = " ".join(["the quick brown fox jumps over the lazy dog"] * 160)
"""Each row's answer: more tokens than a row holds, so every row is cut to exactly data.max_length
(data.overlong: truncate) after its images, and the batch is as long as the plan prices it."""


def _rows(folder: Path, *, images: int, side: int, num_rows: int = 6) -> str:
    colours = [(220, 30, 30), (30, 30, 220), (30, 200, 30)]
    rows = []
    for i in range(num_rows):
        paths = [make_image(folder / "img" / f"{i}-{k}.png", size=(side, side), colour=colours[(i + k) % 3])
                 for k in range(images)]
        row = image_chat(str(paths[0].relative_to(folder)), question="describe", answer=ANSWER)
        row["messages"][0]["content"][1:1] = [{"type": "image", "path": str(p.relative_to(folder))} for p in paths[1:]]
        rows.append(row)
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return "rows.jsonl"


def _prepare(case: str, tmp_path: Path) -> Path:
    """The case's model, rows and recipe, its rows inspected (`data inspect` keeps their images for
    the plan); the recipe's path."""
    from homelab_ft.cli.main import main

    model_type, images, side, vision_targets = CASES[case]
    folder = save_vlm(tmp_path / model_type, model_type, text=TEXT, vision=VISION)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", *vision_targets]
    recipe_path = write_recipe(tmp_path / "r.yaml", tiny_run(
        folder, rows=_rows(tmp_path, images=images, side=side),
        lora={"r": 16, "dropout": 0.0, "target_modules": targets if vision_targets else "all-linear"},
        data={"images": True, "max_length": SEQ, "overlong": "truncate", "shuffle": False,
              "image_max_pixels": side * side, "cache_dir": str(tmp_path / "cache")},
        train={"micro_batch_size": ROWS, "max_steps": 2, "lr": 1e-4, "max_grad_norm": 1.0,
               "activation_checkpointing": False},
        cluster={"device": "cpu", "host_ram_gib": 16, "cpu_gflops_per_core": 50}))
    assert main(["data", "inspect", str(recipe_path), "--no-color"]) == 0
    return recipe_path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """case -> its folder: every case trained and metered in one fresh process (vision_step_peak.py:
    each peak is above the RSS before its own step), one interpreter's imports instead of three."""
    folders = {case: tmp_path_factory.mktemp(case.replace(" ", "_")) for case in CASES}
    argv = [str(a) for case, tmp in folders.items() for a in (_prepare(case, tmp), tmp / "run", tmp / "measured.json")]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(ROOT / "tests" / "e2e" / "vision_step_peak.py"), *argv], env=env, check=True,
                   timeout=1800)
    return folders


def _planned_and_measured(case: str, tmp_path: Path) -> tuple[int, int, dict]:
    from homelab_ft.cli.plan import measured_rows
    from homelab_ft.plan.planner import plan_for_recipe
    from homelab_ft.plan.price import images as priced
    from homelab_ft.recipe.config import load_recipe

    vision_targets = CASES[case][3]
    recipe_path, run = tmp_path / "r.yaml", tmp_path / "run"
    measured = json.loads((tmp_path / "measured.json").read_text())
    assert measured["batch"]["input_ids"] == [ROWS, SEQ]  # the rows the pipeline prepared, cut to max_length
    chosen = json.loads((run / "plan.json").read_text())["chosen"]
    assert chosen["method"] == "lora" and chosen["strategy"] == "no_shard"
    m = chosen["memory"]
    planned = m["total"] - m["context"] - m["fragmentation"] - m["weights"] - m["optimizer"]
    # the same plan here, for what the tower's share of it is
    recipe = load_recipe(recipe_path)
    plan = plan_for_recipe(recipe, **measured_rows(recipe, base_dir=tmp_path))
    assert plan.request.images.counts and plan.chosen.memory.total == m["total"]  # priced at the measured rows
    (count, tokens, _), = plan.request.images.counts
    tower, held = priced.vision_bytes(plan.shape, rung=plan.chosen.rung, request=plan.request, act_bytes=4)
    assert (tower > 0.3 * planned) == bool(vision_targets)  # a tower with adapters is a third of the step or more
    return planned, measured["peak"], {"images_per_row": count, "image_tokens_per_row": tokens,
                                       "tower_saved_mb": round(tower / 1e6, 1), "tower_held_mb": round(held / 1e6, 1),
                                       "loss": measured["loss"]}


@pytest.mark.parametrize("case", list(CASES))
def test_the_planned_step_is_the_measured_peak_within_15_percent(case, runs):
    planned, measured, facts = _planned_and_measured(case, runs[case])
    print(f"{case}: planned {planned / 1e6:.1f} MB, measured {measured / 1e6:.1f} MB, "
          f"measured/planned {measured / planned:.3f} ({facts})")
    assert 0.85 <= measured / planned <= 1.15, (planned, measured, facts)
