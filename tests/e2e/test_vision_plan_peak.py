"""The planner against a measured CPU peak for a batch with images (issue 35: within 15% on two
families): one LoRA step of an image-text model, Qwen2-VL (image tokens that grow with the image,
M-RoPE) and SmolVLM (tiles of a fixed count), each rows of 1024 tokens carrying images, measured in
a fresh process (vision_step_peak.py: the trainer's own train_step, bench/memory.py's peak), against
what the plan says the step adds to the weights and optimizer state (bench/memory.planned_step:
memory.total - overhead - weights - optimizer), priced with the rows' images as data inspect will
measure them (plan_for_recipe's image_counts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from vision_families import save_tiny_vision  # noqa: E402

TEXT = {"hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
        "max_position_embeddings": 2048}
VISION = {"hidden_size": 256, "embed_dim": 256, "intermediate_size": 1024, "num_attention_heads": 4, "num_heads": 4,
          "depth": 4, "num_hidden_layers": 4, "head_dim": 64}
CASES = {
    # name: (family, images per row, side in px, LoRA targets beyond all-linear): Qwen2-VL spends 64 tokens
    # on a 224 px image, 256 on a 448 px one; SmolVLM 10 tiles of 4 on a 192 px one
    "qwen2_vl": ("qwen2_vl", 3, 224, ()),
    "smolvlm": ("smolvlm", 4, 192, ()),
    # adapters in the tower too (its attention and MLP layers, `qkv` `proj` `fc1` `fc2`): it keeps what it
    # saves for backward beside the language model's activations, 6,144 patches of it per micro-batch
    "qwen2_vl tower": ("qwen2_vl", 3, 448, ("qkv", "attn.proj", "fc1", "fc2")),
}
ROWS, SEQ = 2, 1024


def _measure_and_plan(case: str, tmp_path: Path) -> tuple[int, int, dict]:
    from homelab_ft.plan.inputs import Cluster
    from homelab_ft.plan.planner import plan_for_recipe
    from homelab_ft.plan.price import images as priced
    from homelab_ft.plan.shape.cache import cached_image_tokens
    from homelab_ft.recipe.config import recipe_from_dict

    model_type, images, side, vision_targets = CASES[case]
    folder = save_tiny_vision(tmp_path / model_type, model_type, text_sizes=TEXT, vision_sizes=VISION)
    (tokens,) = cached_image_tokens(json.loads((folder / "config.json").read_text()), sizes=((side, side),),
                                    model_path=str(folder))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", *vision_targets]
    recipe = {"model": {"path": str(folder)}, "method": "lora",
              "lora": {"r": 16, "dropout": 0.0, "target_modules": targets if vision_targets else "all-linear"},
              "data": {"max_length": SEQ},
              "train": {"device": "cpu", "micro_batch_size": ROWS, "lr": 1e-4, "max_grad_norm": 1.0,
                        "activation_checkpointing": False}}
    spec = {"recipe": recipe, "rows": ROWS, "images": images, "side": side, "tokens_per_image": tokens, "seq_len": SEQ}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "measured.json"
    subprocess.run([sys.executable, str(ROOT / "tests" / "e2e" / "vision_step_peak.py"), str(folder),
                    str(tmp_path / "spec.json"), str(out)], env=env, check=True, timeout=900)
    measured = json.loads(out.read_text())
    cluster = Cluster(device="cpu", nodes=1, gpus_per_node=1, device_bytes=16 << 30, host_ram_bytes=16 << 30, tflops=0.05)
    plan = plan_for_recipe(recipe_from_dict(recipe), cluster=cluster,
                           image_counts=((images, images * tokens, 100),))
    m, chosen = plan.chosen.memory, plan.chosen
    assert chosen.method == "lora" and chosen.rung.strategy == "no_shard"
    tower, held = priced.vision_bytes(plan.shape, rung=chosen.rung, request=plan.request, act_bytes=4)
    planned = m.total - m.overhead - m.weights - m.optimizer
    assert (tower > 0.3 * planned) == bool(vision_targets)  # a tower with adapters is a third of the step or more
    return planned, measured["peak"], {"tokens_per_image": tokens, "tower_saved_mb": round(tower / 1e6, 1),
                                       "tower_held_mb": round(held / 1e6, 1), **measured}


@pytest.mark.parametrize("case", list(CASES))
def test_the_planned_step_is_the_measured_peak_within_15_percent(case, tmp_path):
    planned, measured, facts = _measure_and_plan(case, tmp_path)
    print(f"{case}: planned {planned / 1e6:.1f} MB, measured {measured / 1e6:.1f} MB, "
          f"measured/planned {measured / planned:.3f} ({facts})")
    assert 0.85 <= measured / planned <= 1.15, (planned, measured, facts)
