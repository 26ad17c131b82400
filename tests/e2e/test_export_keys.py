"""A LoRA run on a base in its released layout, exported and reloaded (export merge through
transformers' key conversion): Qwen 3.5 and Qwen 3.5 MoE image-text (`model.language_model.*`) and
Nemotron-H (`backbone.*`, per-expert tensors). Before, `homelab-ft export` stopped at "the base has no weight for adapted modules".
"""

from __future__ import annotations

import build_recipe
import procs
import pytest
import torch
from keys_models import save_original, saved_keys

from homelab_ft.cli.main import main
from homelab_ft.distributed import comm
from homelab_ft.plan.planner import recipe_shape
from homelab_ft.recipe.config import recipe_from_dict
from homelab_ft.rung import rung_for
from homelab_ft.train import preflight, trainer


def _linear_names(model_dir) -> list[str]:
    """The model's linear layers by name, less the head and out_proj (PEFT refuses a Mamba mixer's)."""
    from homelab_ft.model.checkpoint_keys import meta_model

    names = {n.rsplit(".", 1)[-1] for n, m in meta_model(model_dir).named_modules() if type(m) is torch.nn.Linear}
    return sorted(names - {"lm_head", "out_proj"})


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "nemotron_h"])
def test_lora_run_exports_in_the_base_layout(tmp_path, family):
    from transformers import AutoModelForCausalLM

    base_dir = save_original(tmp_path / "base", family)
    procs.write_chat_data(tmp_path / "train.jsonl", 16, max_q_words=6, max_a_words=4)
    run, out = tmp_path / "run", tmp_path / "export"
    recipe = build_recipe.tiny_run(base_dir, lora={"target_modules": _linear_names(base_dir)}, data={"max_length": 128},
                                   train={"lr": 5e-2, "save_every": 2}, output={"dir": str(run)})
    # The trainer itself, as the distributed tests' worker runs it, with the model facts the planner's
    # shape hands the builder.
    env = comm.setup(device_pref="cpu", timeout_s=60)
    parsed = recipe_from_dict(recipe, source=family)
    rung = rung_for(parsed)
    try:
        inputs = preflight.check_inputs(parsed, rung=rung, facts=recipe_shape(parsed)[0].facts, device_type="cpu")
        trainer._train(parsed, env=env, rung=rung, plan=None, inputs=inputs, base_dir=tmp_path)
    finally:
        comm.teardown(env)
    assert main(["export", str(run), "--out", str(out)]) == 0  # checks merged vs base + adapter logits itself
    assert saved_keys(out) == saved_keys(base_dir)
    ids = torch.randint(3, 300, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)(input_ids=ids).logits
    assert float((merged - base).abs().max()) > 1e-4  # the trained adapter is in the export
