"""`homelab-ft train` on a 2-process recipe, as a user runs it: the parent plans and checks, and
its torchrun workers train the rung it decided (handed down, not planned again). A bad data row
stops the parent before torchrun starts: one line, exit 2, no run directory."""

from __future__ import annotations

import json
import subprocess
import sys

import build_recipe
from procs import REPO, child_env, homelab_ft_here, write_chat_data


def _train(recipe, run, *extra) -> subprocess.CompletedProcess:
    """`homelab-ft train` with its temporary files in TMP beside the run, which must stay empty."""
    return subprocess.run([sys.executable, "-m", "homelab_ft", "train", str(recipe), "--run-dir", str(run), *extra],
                          env=child_env(tmpdir=run.parent / "tmp"), cwd=REPO, capture_output=True, text=True,
                          timeout=600)


def test_two_process_train_uses_the_parents_decision_and_refuses_bad_rows_before_launch(tmp_path, tiny_model_dir):
    write_chat_data(tmp_path / "train.jsonl", 16)
    recipe = build_recipe.write_recipe(tmp_path / "ddp.yaml", build_recipe.tiny_run(
        tiny_model_dir, method="auto", lora={"alpha": None}, data={"max_length": 96},
        train={"lr": 1e-3, "num_threads": 1}, cluster={"gpus_per_node": 2, "device": "cpu"}))
    run = tmp_path / "run"
    proc = _train(recipe, run)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = json.loads((run / "run.json").read_text())
    chosen = json.loads((run / "plan.json").read_text())["chosen"]
    assert (info["method"], info["strategy"], info["cpu_offload"]) == (chosen["method"], chosen["strategy"], chosen["cpu_offload"])
    assert info["world_size"] == 2 and info["procs_per_node"] == 2
    assert proc.stdout.count("training rows") == 1  # rank 0 alone reports
    assert not list((tmp_path / "tmp").iterdir())  # torchrun's log folder removed (cluster/supervise.py)

    (tmp_path / "train.jsonl").open("a").write('{"messages": [{"role": "robot", "content": "hi"}]}\n')
    fresh = tmp_path / "fresh"
    proc = homelab_ft_here(["train", str(recipe), "--run-dir", str(fresh)])  # the parent alone: in this process
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "train.jsonl" in proc.stderr and "torch.distributed" not in proc.stderr
    assert not fresh.exists()
