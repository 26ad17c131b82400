"""objective: grpo is refused by `train` and `launch` before anything is planned or created (its
loop is not built yet, issue 33), after its reward functions resolve: one line, exit 2."""

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


def test_train_and_launch_refuse_the_unbuilt_loop(capsys, tmp_path):
    (tmp_path / "rewards.py").write_text("def short(completions, **kw):\n    return [0.0] * len(completions)\n")
    path, run_dir = _recipe(tmp_path, ["exact_answer", "rewards.py:short"])
    assert "objective=grpo: the GRPO training loop" in _run(capsys, "train", path)
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\n")
    assert "not built yet (issue 33)" in _run(capsys, "launch", "--hosts", hosts, path)
    assert not run_dir.exists() and not (tmp_path / "runs").exists()


def test_a_reward_that_does_not_import_is_the_line_seen(capsys, tmp_path):
    path, run_dir = _recipe(tmp_path, ["exact_answer", "rewards.py:short"])
    err = _run(capsys, "train", path)
    assert "error: grpo.reward_funcs[1] 'rewards.py:short': " in err and "rewards.py does not exist" in err
    assert not run_dir.exists()
