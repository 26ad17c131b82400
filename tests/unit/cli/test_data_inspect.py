"""`homelab-ft data inspect`: the summary and the highlighted sample."""

from __future__ import annotations

import json

from build_recipe import tiny_run, write_recipe
from procs import write_chat_data

from homelab_ft.cli.main import main


def test_inspect_shows_counts_histogram_packing_and_trained_text(tmp_path, tiny_model_dir, capsys):
    rows = [{"messages": [{"role": "user", "content": f"what is {i}"}, {"role": "assistant", "content": f"answer: {i}"}]}
            for i in range(12)]
    rows.append({"messages": [{"role": "user", "content": "x"}]})  # no assistant turn: skipped
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = write_recipe(tmp_path / "r.yaml", tiny_run(
        tiny_model_dir, method="auto", rows="d.jsonl", lora=None, train=None, output=None,
        data={"bad_rows": "skip", "shuffle": False, "max_length": 128, "cache_dir": str(tmp_path / "c")}))
    assert main(["data", "inspect", str(recipe), "--no-color"]) == 0
    out = capsys.readouterr().out
    assert "train: d.jsonl" in out and " 13 " in out  # rows read
    assert "first skipped row:" in out and "row 13: field 'messages' has no assistant turn" in out
    assert "train: 12 samples in 12 rows" in out
    assert sum(int(line.split()[-1]) for line in out.splitlines() if line.startswith("  ") and "-" in line.split()[0]) == 12
    assert "data.packing=true would give" in out
    assert "what is 0<|im_end|>\n<|im_start|>assistant\n[[answer: 0<|im_end|>]]" in out

    assert main(["data", "inspect", str(recipe), "--no-color", "data.packing=true"]) == 0
    out = capsys.readouterr().out
    assert "packing: on; non-pad fraction" in out and "from the cache" in out


def test_inspect_and_plan_say_the_same_of_what_lora_trains(tmp_path, capsys):
    """Before, both said `all-linear: q_proj, k_proj, v_proj, o_proj (4 per block; no routers or Mamba
    projections to leave out)` of an MoE model; now the one line names the experts' adapters, the
    routers and the trainable count, from the planner's shape (no weights loaded)."""
    from families import save_tiny

    model_dir = save_tiny(tmp_path / "moe", "qwen3_moe")
    rows = [{"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"a {i}"}]}
            for i in range(4)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = write_recipe(tmp_path / "r.yaml", tiny_run(
        model_dir, rows="d.jsonl", lora={"alpha": None, "dropout": None, "train_router": True},
        data={"cache_dir": str(tmp_path / "c")}, train={"max_steps": None, "micro_batch_size": None}, output=None))
    capsys.readouterr()
    assert main(["data", "inspect", str(recipe), "--no-color"]) == 0
    inspected = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("lora: "))
    assert main(["plan", str(recipe)]) == 0
    planned = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("lora     "))
    assert inspected.removeprefix("lora: ") == planned.removeprefix("lora     ")
    assert "mlp.experts.{gate_up_proj, down_proj} of each of 4 experts in 4 blocks" in inspected
    assert "routers trained in full (1,024 parameters)" in inspected and "trainable parameters at r=4" in inspected


def test_plan_prices_the_step_at_the_lengths_inspect_measured(tmp_path, tiny_model_dir, capsys):
    """Issue 39 point 5: a CPU plan priced every row at data.max_length; once the data was prepared
    here (`data inspect`, or a run) it prices a micro-batch at its expected longest row."""
    rows = write_chat_data(tmp_path / "d.jsonl", 12)
    recipe = write_recipe(tmp_path / "r.yaml", tiny_run(
        tiny_model_dir, rows=rows, data={"max_length": 512, "cache_dir": str(tmp_path / "c")},
        cluster={"device": "cpu"}, train={"micro_batch_size": 4}))
    main(["plan", str(recipe)])
    assert "timed    rows at data.max_length=512 (their lengths not measured here yet" in capsys.readouterr().out
    before = json.loads(_plan_json(recipe, capsys))["chosen"]["step_s"]
    assert main(["data", "inspect", str(recipe), "--no-color"]) == 0
    capsys.readouterr()
    main(["plan", str(recipe)])
    assert "of the 12 rows measured when the data was last prepared" in capsys.readouterr().out
    assert json.loads(_plan_json(recipe, capsys))["chosen"]["step_s"] < before / 5  # rows of ~20 tokens, not 512


def _plan_json(recipe, capsys) -> str:
    main(["plan", str(recipe), "--json"])
    return capsys.readouterr().out


def test_inspect_reports_image_tokens_and_the_rows_that_would_not_fit(tmp_path, capsys):
    from tiny_vlm import image_chat, make_image, save_vlm

    folder = save_vlm(tmp_path / "m", "qwen2_vl")  # `data inspect` checks the folder as `train` does
    make_image(tmp_path / "large.png", size=(112, 112))  # 16 image tokens (and its two markers)
    make_image(tmp_path / "small.png", size=(28, 28))  # 1 (and 2)
    late = image_chat("large.png")
    late["messages"][0]["content"].reverse()  # the question, then the image: its tokens end past 28
    (tmp_path / "d.jsonl").write_text(json.dumps(late) + "\n" + json.dumps(image_chat("small.png")) + "\n")
    recipe = write_recipe(tmp_path / "r.yaml", tiny_run(
        folder, method="full", rows="d.jsonl", lora=None, train=None, output=None,
        data={"images": True, "shuffle": False, "max_length": 28, "cache_dir": str(tmp_path / "c")}))
    main(["plan", str(recipe)])  # no bound: an image may fill the row as far as the planner knows
    assert "rows priced with one image of 28 tokens (unbounded" in capsys.readouterr().out
    assert main(["data", "inspect", str(recipe), "--no-color"]) == 0
    out = capsys.readouterr().out
    assert "images: 1 in 1 of 1 samples; image tokens per sample 1-1" in out
    assert "would not fit: 1 row(s) whose image tokens cross max_length 28" in out and "d.jsonl: row 1" in out
    main(["plan", str(recipe)])  # the rows' images as inspect measured them, as `train` plans them too
    assert "rows as measured on 1: up to 1 image(s) and 1 image tokens" in capsys.readouterr().out
