"""FSDP2 on 2 gloo processes filled from checkpoints in their released layout (keys_models.py).

Before checkpoint_keys.py the sharded loader read each tensor by its parameter name, so a
per-expert MoE checkpoint stopped at "has no weight model.layers.0.mlp.experts.gate_up_proj",
Nemotron-H at `model.embeddings.weight` (its file says `backbone.`) and a Qwen 3.5 image-text
checkpoint at `model.embed_tokens.weight` (its file says `model.language_model.`). Now every
rank's shards, gathered, equal what from_pretrained loads, and so do the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from keys_models import save_original
from procs import Workers, job_recipe, run_checked

FULL = ("mixtral", "nemotron_h", "qwen3_5", "qwen3_5_moe")
"""A per-expert MoE, a Mamba hybrid with MoE and `backbone.*`, an image-text hybrid and its MoE sibling."""
QLORA = ("qwen3_5",)
"""The sharded 4-bit fill (sharded_qlora.py) on an image-text checkpoint's text decoder."""


def _recipe(tmp: Path, model_dir: Path, name: str, *, method: str) -> dict:
    return job_recipe(tmp, model_dir, name, procs=2, method=method, sharding={"strategy": "full_shard"},
                      lora={"target_modules": ["q_proj", "v_proj"]}, train={"max_steps": 1, "micro_batch_size": 1})


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("keys-fsdp")
    dirs = {family: save_original(tmp / family, family) for family in dict.fromkeys(FULL + QLORA)}
    # 7 experts and 321 embedding rows: uneven dim-0 shards (4 + 3, 161 + 160) on 2 ranks
    dirs["uneven"] = save_original(tmp / "uneven", "mixtral", vocab_size=321, num_local_experts=7)
    jobs = [{"kind": "keys", "name": f"full_{f}", "recipe": _recipe(tmp, dirs[f], f"full_{f}", method="full")} for f in FULL + ("uneven",)]
    jobs += [{"kind": "keys", "name": f"qlora_{f}", "recipe": _recipe(tmp, dirs[f], f"qlora_{f}", method="qlora")} for f in QLORA]
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"base_dir": str(tmp), "jobs": jobs}))
    run_checked(Workers(spec, tmp / "out.json", nprocs=2), timeout=900)
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.parametrize("family", (*FULL, "uneven"))
def test_sharded_parameters_equal_from_pretrained(results, family):
    got = results[f"full_{family}"]
    assert got["missing"] == [] and got["unexpected"] == [] and got["unequal"] == []
    assert got["num_tensors"] > 0
    assert got["logit_diff"] <= 1e-5


@pytest.mark.parametrize("family", QLORA)
def test_sharded_4bit_fill_equals_one_gpu_4bit(results, family):
    """The same quantised bytes from the renamed tensors: logits equal the one-GPU 4-bit model's."""
    assert results[f"qlora_{family}"]["logit_diff"] == 0.0
