"""The non-finite guard on 2 gloo processes, as a user runs it (`homelab-ft train` under torchrun):
LoRA under DDP and under FSDP2 with lora.alpha 1e30 stops every rank at the same first step, with
one line (rank 0's) and exit 3, and records it. The command runs in this process (procs.homelab_ft_here);
its torchrun agent and ranks are real processes."""

from __future__ import annotations

import json

import build_recipe
import pytest
from procs import homelab_ft_here, write_chat_data


@pytest.mark.parametrize("strategy", ["no_shard", "full_shard"])
def test_every_rank_stops_at_the_same_nonfinite_step(tmp_path, tiny_model_dir, strategy):
    write_chat_data(tmp_path / "train.jsonl", 16)
    recipe = build_recipe.write_recipe(tmp_path / "r.yaml", build_recipe.tiny_run(
        tiny_model_dir, lora={"alpha": 1e30}, data={"max_length": 96},
        train={"max_steps": 4, "micro_batch_size": 1, "lr": 1e-3, "num_threads": 1, "skip_nonfinite_steps": 1,
               "save_every": 1},
        cluster={"gpus_per_node": 2, "device": "cpu"}, sharding={"strategy": strategy}))
    run = tmp_path / "run"
    proc = homelab_ft_here(["-q", "train", str(recipe), "--run-dir", str(run)])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("homelab-ft:")]
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(lines) == 1 and "step 2" in lines[0] and "after skipping 1" in lines[0], proc.stderr[-3000:]
    assert json.loads((run / "diverged.json").read_text())["step"] == 2
    assert json.loads((run / "run.json").read_text())["strategy"] == strategy
    # rank 0 alone logs; a rank that went on (or stopped earlier) would hang or fail the collectives above
    assert [r["skipped_nonfinite"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [1, 2]
