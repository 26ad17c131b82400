"""The bad-input corpus (issue 37): one row per case, every command. Each gives one line on stderr
naming what to fix, exit 2, no traceback, and writes nothing (the working folder, where relative
run directories would land, is compared file by file before and after).

Deeper cases of one area live beside it (test_cli_errors.py: recipes and run directories;
test_bad_model_folders.py: damaged model folders; test_generate_args.py: decoding flags); this
table is the map across commands. `{recipe}` is a recipe that would train (the tiny model, a small
dataset), `{dir}` the test's folder."""

from __future__ import annotations

import shutil

import build_recipe
import pytest

from homelab_ft.cli.main import main

CORPUS = [
    # (command line, what is wrong, what the line must say)
    ("plan nope.yaml", "recipe file missing", "recipe nope.yaml not found"),
    ("plan {dir}/typo.yaml", "misspelt section", "unknown key trian; did you mean train?"),
    ("plan {recipe} train.lr=-1", "value out of range", "train.lr = -1: input should be greater than 0"),
    ("plan {recipe} --gpus 2xbanana", "GPU size not a size", "--gpus 'banana': not a size"),
    ("plan {recipe} --link fast", "link speed not a speed", "--link 'fast': write the Ethernet speed"),
    ("plan {recipe} --nodes 0", "no nodes", "--nodes 0: needs at least 1 node"),
    ("plan {recipe} --cluster {dir}/nope.yaml", "cluster file missing", "--cluster {dir}/nope.yaml: no such file"),
    ("train {dir}/empty.yaml", "empty recipe", "the recipe is empty"),
    ("train {recipe} model.path={dir}/nope", "model folder missing", "model.path: {dir}/nope does not exist"),
    ("train {recipe} --run-dir {dir}/afile", "run directory is a file", "afile is a file, not a directory"),
    ("train {recipe} --resume", "nothing to resume", "so there is nothing to resume"),
    ("train {recipe} train.max_steps=0", "zero steps", "train.max_steps = 0: input should be greater than or equal to 1"),
    ("train {recipe} lora.target_modules=[q_proj,v_prj]", "LoRA target typo", "'v_prj' matches no module"),
    ("train {recipe} --bogus", "unknown flag", "unrecognized arguments: --bogus"),
    ("data inspect {dir}/nope.yaml", "recipe file missing", "recipe {dir}/nope.yaml not found"),
    ("data inspect {recipe} data.sources=[]", "no training data", "data.sources is empty"),
    ("export {dir} --out {dir}/x", "not a run directory", "is not a homelab-ft run directory (no run.json)"),
    ("export {dir} --out {dir}/x --format bogus", "unknown format", "--format 'bogus': choose safetensors, gguf"),
    ("export {dir} --out {dir}/x --dtype int3", "unknown dtype", "argument --dtype: invalid choice: 'int3'"),
    ("export {dir} --out {dir}/afile", "--out is a file", "is a file, not a directory"),
    ("generate {dir}/nope --prompt hi", "model folder missing", "model.path: {dir}/nope does not exist"),
    ("generate smollm2 --prompt ''", "empty prompt", "argument --prompt: the prompt is empty"),
    ("generate smollm2 --prompt hi --max-new-tokens 0", "nothing to generate", "--max-new-tokens: 0 generates nothing"),
    ("generate smollm2 --prompt hi --top-p 2", "top-p above 1", "--top-p: 2 is out of range"),
    ("chat {dir} --prompt hi", "not a run directory", "is not a homelab-ft run directory (no run.json)"),
    ("chat {dir} --temperature -1", "negative temperature", "--temperature: -1 is out of range"),
    ("launch {recipe} --hosts {dir}/nope.txt", "hostfile missing", "hostfile {dir}/nope.txt not found"),
    ("launch {recipe} --hosts {dir}/bad_hosts", "option-like host", "line 2: '-evil' is not a host name or address"),
    ("launch {recipe} --hosts {dir}/two_hosts", "hostfile and cluster.nodes disagree", "lists 2 host(s) but the recipe's cluster.nodes is 1"),
    ("launch {recipe} --hosts {dir}/two_hosts cluster.nodes=2 --port 99999", "port out of range", "--port 99999 is not a TCP port"),
    ("doctor --hosts {dir}/nope.txt", "hostfile missing", "hostfile {dir}/nope.txt not found"),
    ("doctor --nproc-per-node 0", "no processes", "--nproc-per-node 0: needs at least 1 process per node"),
    ("doctor {dir}/nope.yaml", "recipe file missing", "recipe {dir}/nope.yaml not found"),
    ("recipes --bogus", "unknown flag", "unrecognized arguments: --bogus"),
    ("demo --bogus", "unknown flag", "unrecognized arguments: --bogus"),
]


@pytest.fixture()
def folder(tmp_path, tiny_model_dir, monkeypatch):
    """The test's folder, the working directory: a recipe that would train, and the bad files the rows name."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"}]}\n' * 8)
    build_recipe.write_recipe(tmp_path / "r.yaml", build_recipe.tiny_run(model, rows=data, lora=None, train={"max_steps": 1}))
    (tmp_path / "typo.yaml").write_text("method: lora\ntrian:\n  lr: 1\n")
    (tmp_path / "empty.yaml").write_text("{}\n")
    (tmp_path / "afile").write_text("keep me")
    (tmp_path / "bad_hosts").write_text("host-a\n-evil\n")
    (tmp_path / "two_hosts").write_text("10.0.0.1\n10.0.0.2\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _tree(root):
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("line,wrong,says", CORPUS, ids=[f"{c.split()[0]}: {w}" for c, w, _ in CORPUS])
def test_bad_input_is_one_line_and_writes_nothing(capsys, folder, line, wrong, says):
    import shlex

    argv = shlex.split(line.format(dir=folder, recipe=folder / "r.yaml"))
    before = _tree(folder)
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's refusals end the process
        code = exit_.code
    err = capsys.readouterr().err.strip()
    assert code == 2, (wrong, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, (wrong, err)
    assert says.format(dir=folder) in err, (wrong, err)
    assert _tree(folder) == before, wrong
