"""What `train` and `launch` refuse of objective: grpo before anything is planned or created: a reward
function that does not import, a full fine-tune with a reference (beta > 0), a pipeline: one line, exit 2."""

from __future__ import annotations

import yaml

from homelab_ft.cli.main import main


def _run(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _recipe(tmp_path, reward_funcs) -> tuple:
    run_dir = tmp_path / "runs" / "g"
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump({"objective": "grpo", "output": {"dir": str(run_dir)},
                                    "grpo": {"reward_funcs": reward_funcs}}))
    return path, run_dir


def test_train_and_launch_resolve_the_rewards_first(capsys, tmp_path):
    path, run_dir = _recipe(tmp_path, ["exact_answer", "rewards.py:short"])
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\n")
    assert "rewards.py does not exist" in _run(capsys, "launch", "--hosts", hosts, path)
    assert not run_dir.exists() and not (tmp_path / "runs").exists()


def test_a_full_fine_tune_with_a_reference_and_a_pipeline_are_refused(capsys, tmp_path):
    path, run_dir = _recipe(tmp_path, ["exact_answer"])
    err = _run(capsys, "train", path, "method=full", "grpo.beta=0.04")
    assert "objective=grpo with grpo.beta > 0 needs a reference model" in err and "grpo.beta=0" in err
    err = _run(capsys, "train", path, "method=lora", "sharding.pipeline_stages=2", "cluster.gpus_per_node=2",
               "train.device=cpu", "train.grad_accum_steps=4")
    assert "objective=grpo" in err and "objective: sft" in err
    assert not run_dir.exists()


def test_a_reward_that_does_not_import_is_the_line_seen(capsys, tmp_path):
    path, run_dir = _recipe(tmp_path, ["exact_answer", "rewards.py:short"])
    err = _run(capsys, "train", path)
    assert "error: grpo.reward_funcs[1] 'rewards.py:short': " in err and "rewards.py does not exist" in err
    assert not run_dir.exists()
