"""MoE QLoRA and LoRA through the real `homelab-ft train` and `export` on a tiny random qwen3_moe
(issue 21): 4-bit experts on one process, adapters on every expert, resume, the merged export."""

from __future__ import annotations

import json
import shutil

import build_recipe
import pytest
import torch
import yaml
from families import save_tiny
from procs import write_chat_data

from homelab_ft.cli.main import main
from homelab_ft.train.metrics import read_metrics

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe-data")
    write_chat_data(folder / "train.jsonl", 8, answer_prefix="answer: ", max_q_words=3, max_a_words=3)
    return folder


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("moe-base"), "qwen3_moe")


def _recipe(tmp_path, data_dir, model_dir, method: str, *, steps: int = 2, **extra) -> object:
    """`extra`'s sections replace the defaults' whole (a `lora` given is the whole lora section)."""
    return build_recipe.write_recipe(tmp_path / f"{method}.yaml", build_recipe.tiny_run(
        model_dir, method=method, rows=data_dir / "train.jsonl", output=None,
        train={"max_steps": steps, "grad_accum_steps": 1, "lr": 1e-2, "warmup_steps": 0, "eval_every": 0,
               "save_every": 2}) | extra)


def _losses(run) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}


def test_moe_qlora_trains_with_4bit_experts(tmp_path, data_dir, moe_dir, capfd):
    """Before: `method: qlora` on qwen3_moe was refused (fused experts stayed in bf16)."""
    run = tmp_path / "run"
    assert main(["train", str(_recipe(tmp_path, data_dir, moe_dir, "qlora")), "--run-dir", str(run)]) == 0
    out, err = capfd.readouterr()
    assert "4-bit experts: 4 fused-experts modules packed (nf4)" in out + err
    losses = _losses(run)
    assert sorted(losses) == [1, 2] and all(torch.isfinite(torch.tensor(v)) for v in losses.values())


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_moe_adapters_train_every_expert_and_resume_exactly(tmp_path, data_dir, moe_dir, method):
    """Before: all-linear on qwen3_moe trained attention only (the experts are 3-D parameters).
    Now every expert has an adapter; 2 + 2 steps from a checkpoint equal 4 steps, on a bf16 base
    and on the 4-bit base filled block by block."""
    from safetensors.torch import load_file

    from homelab_ft.store.model_state import EXPERT_ADAPTERS

    recipe = _recipe(tmp_path, data_dir, moe_dir, method, steps=4)
    whole = tmp_path / "whole"
    assert main(["train", str(recipe), "--run-dir", str(whole)]) == 0
    experts = load_file(str(whole / "checkpoints" / "step_000004" / "adapter" / EXPERT_ADAPTERS))
    assert len(experts) == 4 * 2 * 2  # 4 layers x (gate_up_proj, down_proj) x (A, B)
    assert all(t.abs().max() > 0 for k, t in experts.items() if k.endswith("lora_B"))  # trained from zero
    # a crash after step 2: the step-4 checkpoint and the metrics after step 2 gone, then --resume
    split = tmp_path / "split"
    shutil.copytree(whole, split)
    shutil.rmtree(split / "checkpoints" / "step_000004")
    rows = (split / "metrics.jsonl").read_text().splitlines()
    (split / "metrics.jsonl").write_text("".join(r + "\n" for r in rows if json.loads(r).get("step", 0) <= 2))
    assert sorted(_losses(split)) == [1, 2]
    assert main(["train", str(recipe), "--run-dir", str(split), "--resume"]) == 0
    assert _losses(split) == pytest.approx(_losses(whole), rel=1e-6, abs=1e-6)


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()


IDS = torch.tensor([[1, 5, 17, 40, 99, 23, 7, 64]])


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_moe_export_merges_the_expert_adapters(tmp_path, data_dir, model_type, method):
    """The merged export (file by file, the checkpoint's own per-expert keys) reloads with
    from_pretrained and its logits equal base + PEFT adapter + expert adapters in fp32; the
    expert adapters alone move the logits (before: they were not trained, nor merged)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from homelab_ft.export import merged
    from homelab_ft.model import moe_experts
    from homelab_ft.recipe.config import load_recipe

    model_dir = save_tiny(tmp_path / "base", model_type)
    recipe = _recipe(tmp_path, data_dir, model_dir, method)
    run = tmp_path / "run"
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 0
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out), "--dtype", "float32"]) == 0
    ckpt = run / "checkpoints" / "step_000002"
    with safe_open(str(model_dir / "model.safetensors"), "pt") as fh, safe_open(str(out / "model.safetensors"), "pt") as gh:
        assert sorted(fh.keys()) == sorted(gh.keys())  # the base's own layout
    reference = merged.load_base_with_adapter(ckpt, model_dir, load_recipe(recipe))
    want = _logits(reference, IDS)
    got = _logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), IDS)
    assert (got - want).abs().max() <= 1e-4 * max(1.0, float(want.abs().max()))
    for module in moe_experts.fused_experts(reference).values():
        del module.expert_lora
        del module.forward
    assert (_logits(reference, IDS) - want).abs().max() > 1e-5  # the expert adapters matter
    assert main(["export", str(run), "--out", str(tmp_path / "adapter"), "--adapter-only"]) == 2


def test_moe_qlora_loads_experts_block_by_block(tmp_path):
    """One-process MoE QLoRA: the fused experts are quantized per expert as the safetensors are read
    (distributed/sharded_experts.py), so the load never holds them whole in the compute dtype. Before:
    `from_pretrained` loaded every expert in fp32 (bitsandbytes quantizes nn.Linear only) and only then
    were they packed: the peak was all the experts in fp32 (150 MB here: 295-299 MB measured, against a budget of
    111 MB; now 51-85 MB), ~57 GB in bf16 for Qwen3-30B-A3B."""
    import subprocess
    import sys

    from families import tiny_config
    from procs import REPO, child_env
    from transformers import AutoModelForCausalLM

    # 6 layers x 16 experts x 3 projections of 256 x 512: 25 MB of experts per layer in fp32, 150 MB
    # in all, far above the RSS noise of a Python process; stored in bf16 as released models are.
    config = tiny_config("qwen3_moe", hidden_size=256, moe_intermediate_size=512, num_experts=16,
                         num_local_experts=16, num_hidden_layers=6)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "wide")
    recipe = build_recipe.tiny_run(tmp_path / "wide", method="qlora", rows=tmp_path / "unused.jsonl",
                                   data={"max_length": None}, train={"max_steps": None, "micro_batch_size": None},
                                   output=None)
    (tmp_path / "recipe.json").write_text(json.dumps(recipe))
    script = REPO / "tests" / "e2e" / "moe_load_peak.py"
    subprocess.run([sys.executable, str(script), str(tmp_path / "recipe.json"), str(tmp_path / "out.json")],
                   env=child_env(), check=True, timeout=600, cwd=REPO)
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["baseline_valid"], got
    assert got["packed_dtypes"] == ["torch.uint8"]  # bitsandbytes' own storage where nothing shards
    # the packed model + one layer's experts in fp32 + slack: the read of one projection holds its bf16
    # sources, their stacks and the concatenation (~30 MB at once, sampled), and the allocator's arenas
    # varied the peak by up to 30 MB between runs (51-85 MB measured)
    budget = got["model_bytes"] + got["layer_experts_bytes"] + 64 * 2**20
    assert got["load_peak_bytes"] <= budget, got


def test_moe_qlora_pipeline_is_refused_before_the_run_exists(tmp_path, data_dir, moe_dir, capfd):
    """4-bit experts are not built in pipeline stages yet: `homelab-ft train` says so in one line
    (exit 2) before any file is written or process launched, and the planner does not offer it either.
    Before: refused inside the launched workers, after tokenising, in the "shards or pipelines" line."""
    recipe = _recipe(tmp_path, data_dir, moe_dir, "qlora", cluster={"nodes": 1, "gpus_per_node": 2},
                     sharding={"pipeline_stages": 2})
    text = yaml.safe_load(recipe.read_text())
    text["train"]["grad_accum_steps"] = 2
    recipe.write_text(yaml.safe_dump(text))
    run = tmp_path / "run"
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 2
    assert "does not pipeline yet" in capfd.readouterr().err


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_train_router_trains_saves_resumes_and_exports_the_routers(tmp_path, data_dir, moe_dir, method):
    """lora.train_router: the routers change in training (unchanged without it), are saved beside the
    adapters, resume exactly (2 + 2 steps equal 4), and the merged export holds the trained routers:
    its logits equal base + adapters + trained routers, not those with the base's routers."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from homelab_ft.export import merged
    from homelab_ft.recipe.config import load_recipe
    from homelab_ft.rules import moe_routers
    from homelab_ft.store.model_state import ROUTERS

    base = load_file(str(moe_dir / "model.safetensors"))
    recipe = _recipe(tmp_path, data_dir, moe_dir, method, steps=4, **{"lora": {"r": 4, "alpha": 8, "dropout": 0.0,
                                                                               "train_router": True}})
    whole = tmp_path / "whole"
    assert main(["train", str(recipe), "--run-dir", str(whole)]) == 0
    ckpt = whole / "checkpoints" / "step_000004"
    routers = load_file(str(ckpt / "adapter" / ROUTERS))
    assert sorted(routers) == [f"model.layers.{i}.mlp.gate.weight" for i in range(4)]
    assert all((routers[k] - base[k]).abs().max() > 1e-4 for k in routers)  # trained
    split = tmp_path / "split"
    shutil.copytree(whole, split)
    shutil.rmtree(split / "checkpoints" / "step_000004")
    rows = (split / "metrics.jsonl").read_text().splitlines()
    (split / "metrics.jsonl").write_text("".join(r + "\n" for r in rows if json.loads(r).get("step", 0) <= 2))
    assert main(["train", str(recipe), "--run-dir", str(split), "--resume"]) == 0
    assert _losses(split) == pytest.approx(_losses(whole), rel=1e-6, abs=1e-6)
    resumed = load_file(str(split / "checkpoints" / "step_000004" / "adapter" / ROUTERS))
    assert all(torch.equal(resumed[k], routers[k]) for k in routers)

    out = tmp_path / "export"
    assert main(["export", str(whole), "--out", str(out), "--dtype", "float32"]) == 0
    exported = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(exported[k], routers[k].float()) for k in routers)
    reference = merged.load_base_with_adapter(ckpt, moe_dir, load_recipe(recipe))
    want = _logits(reference, IDS)
    got = _logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), IDS)
    assert (got - want).abs().max() <= 1e-4 * max(1.0, float(want.abs().max()))
    with torch.no_grad():
        for name, module in moe_routers.routers(reference).items():
            module.weight.copy_(base[name.removeprefix("base_model.model.") + ".weight"])
    assert (_logits(reference, IDS) - want).abs().max() > 1e-5  # the trained routers matter
    assert main(["export", str(whole), "--out", str(tmp_path / "adapter"), "--adapter-only"]) == 2


@pytest.mark.parametrize("train_router", [False, True])
def test_the_plan_counts_what_the_run_trains(tmp_path, data_dir, moe_dir, capfd, train_router):
    """`plan`'s lora line and the trainer's start line (loading.count_params) give one count."""
    recipe = _recipe(tmp_path, data_dir, moe_dir, "lora", **{"lora": {"r": 4, "train_router": train_router}})
    capfd.readouterr()
    assert main(["plan", str(recipe)]) == 0
    line = next(x for x in capfd.readouterr().out.splitlines() if x.startswith("lora     "))
    count = line.rsplit("; ", 1)[1].split(" trainable")[0]
    assert main(["train", str(recipe), "--run-dir", str(tmp_path / "run")]) == 0
    out, err = capfd.readouterr()
    assert f"{count} trainable of " in out + err, (line, count)


def test_without_train_router_the_routers_stay_the_base_s(tmp_path, data_dir, moe_dir):
    from safetensors.torch import load_file

    from homelab_ft.store.model_state import ROUTERS

    run = tmp_path / "run"
    assert main(["train", str(_recipe(tmp_path, data_dir, moe_dir, "lora")), "--run-dir", str(run)]) == 0
    assert not (run / "checkpoints" / "step_000002" / "adapter" / ROUTERS).exists()
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out), "--dtype", "float32"]) == 0
    base, exported = load_file(str(moe_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.equal(exported[k], base[k].float()) for k in base if k.endswith("mlp.gate.weight"))


def test_train_router_on_a_dense_model_is_refused_before_anything_is_written(tmp_path, data_dir, capfd):
    dense = save_tiny(tmp_path / "dense", "llama")
    recipe = _recipe(tmp_path, data_dir, dense, "lora", **{"lora": {"train_router": True}})
    run = tmp_path / "run"
    capfd.readouterr()
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lora.train_router: true, but model.path" in err[0] and "(llama" in err[0], err
    assert "has no MoE router to train" in err[0] and err[0].endswith("set lora.train_router: false"), err
    assert not run.exists()
