"""Pipeline parallelism (distributed/pipeline.py) on 2 gloo processes against one process.

One launch of 2 processes runs every pipelined job (each torchrun costs seconds on 2 cores), one
plain process the references. The two stages of a pipeline read the same micro-batches and one
process with the same micro_batch_size and grad_accum_steps sees exactly those rows, so losses and
the gradients of every step must agree to float rounding (micro-batches are padded to
data.max_length for the pipeline and to their longest row for one process: the masked positions
change nothing but the order of a few float sums). 4 micro-batches over 2 stages, 4 steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from procs import Workers, job_recipe, run_beside, write_chat_data

TOL = 1e-5
STEPS = 4


def _recipe(tmp: Path, model_dir: Path, name: str, *, procs: int, method: str = "full",
            sharding: dict | None = None, train: dict | None = None, data: dict | None = None) -> dict:
    """`procs` processes as 2 stages x procs/2 replicas (1: the one-process reference), each replica
    with micro-batches of 2 / replicas rows: every run trains the same rows per step."""
    replicas = max(procs // 2, 1)
    return job_recipe(tmp, model_dir, name, procs=procs, method=method,
                      sharding={"strategy": "no_shard", "pipeline_stages": 2, **(sharding or {})},
                      data={"max_length": 96, **(data or {})},
                      train={"max_steps": STEPS, "micro_batch_size": 2 // replicas, "grad_accum_steps": 4,
                             "lr": 5e-3 if method == "lora" else 1e-3, "loss_chunk_tokens": 16, "save_every": 0,
                             **(train or {})},
                      output={"dir": str(tmp / "runs" / f"{name}-{procs}")})


CASES = {
    # name: (model, method, sharding of the pipelined run)
    "full": ("plain", "full", {}),
    "lora": ("plain", "lora", {}),
    "tied_full": ("tied", "full", {}),
    "uneven": ("deep", "full", {"stage_blocks": [3, 1]}),
    "gpipe_lora": ("deep", "lora", {"pipeline_schedule": "gpipe"}),
    # a 4-bit base per stage, quantised from the stage's own tensors, against the one-process 4-bit
    # load (an unquantised stage would differ from it by the quantisation error, far above TOL)
    "qlora": ("deep", "qlora", {"stage_blocks": [3, 1]}),
    "checkpointing": ("plain", "full", {}),
    "packed_lora": ("plain", "lora", {}),
}
EXTRA = {
    "checkpointing": {"train": {"activation_checkpointing": True}},  # each stage's blocks recomputed in backward
    "packed_lora": {"data": {"packing": True}},  # position_ids and no attention mask cross the stages
}
TWO_BY_TWO = ("full", "lora")
EVALUATED = ("full",)  # a held-out split of 9 rows, evaluated after steps 2 and 4 (evaluate_pipeline)
RESUMED = ("full", "tied_full", "lora")
EXPORTED = ("full", "tied_full", "lora")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    from tiny import make_llama

    tmp = tmp_path_factory.mktemp("pipeline")
    write_chat_data(tmp / "train.jsonl", 48)
    write_chat_data(tmp / "eval.jsonl", 9, seed=1)  # not a multiple of any micro-batch or step: filler rows run
    held_out = {"data": {"eval_sources": [{"path": str(tmp / "eval.jsonl")}]}, "train": {"eval_every": 2}}
    models = {"plain": make_llama(tmp / "plain"), "tied": make_llama(tmp / "tied", tie_word_embeddings=True),
              "deep": make_llama(tmp / "deep", num_hidden_layers=4)}
    two, one = [], []
    for name, (model, method, sharding) in CASES.items():
        grads = str(tmp / f"{name}")
        saves = {"save_every": 2} if name in RESUMED else {}
        extra = held_out if name in EVALUATED else EXTRA.get(name, {})
        train, data = extra.get("train", {}), extra.get("data")
        two.append({"kind": "train", "name": name, "capture_grads": grads + "-pp",
                    "recipe": _recipe(tmp, models[model], name, procs=2, method=method, sharding=sharding,
                                      train={**saves, **train}, data=data)})
        one.append({"kind": "train", "name": name, "capture_grads": grads + "-one", "reset_adapters": method == "lora",
                    "recipe": _recipe(tmp, models[model], name, procs=1, method=method, train=train, data=data)})
    # Resumed from the pipelined run's checkpoint of step 2: on 2 stages again, and on one process.
    for name in RESUMED:
        model, method, sharding = CASES[name]
        source = {"src": two[list(CASES).index(name)]["recipe"]["output"]["dir"], "keep_step": 2}
        data = held_out["data"] if name in EVALUATED else None  # a resume reads the data it was trained with
        two.append({"kind": "train", "name": f"{name}_resume2", "copy_run": source,
                    "recipe": _recipe(tmp, models[model], f"{name}_resume2", procs=2, method=method, sharding=sharding,
                                      train={"resume": True}, data=data)})
        one.append({"kind": "train", "name": f"{name}_resume1", "copy_run": source,
                    "recipe": _recipe(tmp, models[model], f"{name}_resume1", procs=1, method=method,
                                      train={"resume": True}, data=data)})
    # 2 stages x 2 data-parallel replicas (DDP over each stage's replicas) against the same references
    four = [{"kind": "train", "name": name, "capture_grads": str(tmp / f"{name}-pp4"),
             "recipe": _recipe(tmp, models[CASES[name][0]], name, procs=4, method=CASES[name][1],
                               **(held_out if name in EVALUATED else {}))} for name in TWO_BY_TWO]
    (tmp / "four.json").write_text(json.dumps({"base_dir": str(tmp), "jobs": four}))
    # `homelab-ft export` of the pipelined run and of the one-process run: one merged HF folder each
    for name in EXPORTED:
        for procs, jobs in ((2, two), (1, one)):
            run_dir = next(j for j in jobs if j["name"] == name)["recipe"]["output"]["dir"]
            one.append({"kind": "export_run", "name": f"{name}_export{procs}", "run_dir": run_dir,
                        "out": str(tmp / f"export-{name}-{procs}"), "model_dir": str(models[CASES[name][0]])})
    (tmp / "two.json").write_text(json.dumps({"base_dir": str(tmp), "jobs": two}))
    # The one-process references beside the 2-stage runs; the resumes and exports of both, which read
    # their checkpoints, beside the 2x2 runs.
    after = [job for job in one if "copy_run" in job or job["kind"] == "export_run"]
    (tmp / "one.json").write_text(json.dumps({"base_dir": str(tmp), "jobs": [j for j in one if j not in after]}))
    (tmp / "after.json").write_text(json.dumps({"base_dir": str(tmp), "jobs": after}))
    run_beside(Workers(tmp / "two.json", tmp / "two.out.json", nprocs=2),
               Workers(tmp / "one.json", tmp / "one.out.json"))
    run_beside(Workers(tmp / "four.json", tmp / "four.out.json", nprocs=4),
               Workers(tmp / "after.json", tmp / "after.out.json"))
    out = {"two": json.loads((tmp / "two.out.json").read_text()),
           "one": {**json.loads((tmp / "one.out.json").read_text()), **json.loads((tmp / "after.out.json").read_text())}}
    out["four"] = json.loads((tmp / "four.out.json").read_text())
    out["export_logit_diff"] = {name: _logit_diff(tmp / f"export-{name}-2", tmp / f"export-{name}-1") for name in EXPORTED}
    out["adapter_keys"] = _safetensors_keys(Path(two[list(CASES).index("lora")]["recipe"]["output"]["dir"])
                                            / "checkpoints" / f"step_{STEPS:06d}" / "adapter")
    out["grads"], out["grads4"] = {}, {}
    for name in CASES:
        reference = torch.load(tmp / f"{name}-one.rank0.pt")
        out["grads"][name] = {"one": reference, "stages": [torch.load(tmp / f"{name}-pp.rank{r}.pt") for r in range(2)]}
        if name in TWO_BY_TWO:  # ranks are stage-major: 0, 1 hold stage 0; 2, 3 stage 1
            replicas = [[torch.load(tmp / f"{name}-pp4.rank{stage * 2 + r}.pt") for stage in range(2)] for r in range(2)]
            out["grads4"][name] = [{"one": reference, "stages": stages} for stages in replicas]
    return out


def _max_grad_diff(grads: dict) -> tuple[float, int]:
    """Max abs difference over every step and every parameter of one process, and the count compared."""
    worst, compared = 0.0, 0
    for step, reference in enumerate(grads["one"]):
        merged = {**grads["stages"][0][step], **grads["stages"][1][step]}
        for name, grad in reference.items():
            worst = max(worst, float((merged[name] - grad).abs().max()))
            compared += 1
    return worst, compared


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_matches_one_process(results, name):
    losses, ref = results["two"][name]["losses"], results["one"][name]["losses"]
    assert len(losses) == STEPS
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref, strict=True))
    grad_diff, compared = _max_grad_diff(results["grads"][name])
    print(f"{name}: loss max abs diff {loss_diff:.2e}, grad max abs diff {grad_diff:.2e} ({compared} tensors)")
    assert loss_diff < TOL, (losses, ref)
    assert grad_diff < TOL
    assert compared >= STEPS * 3


@pytest.mark.parametrize("procs", ["two", "four"])
def test_pipelined_held_out_loss_matches_one_process(results, procs):
    """The held-out pass through the stages (2 stages; 2 stages x 2 replicas, the batches dealt to
    the replicas), short batches and rounds filled with rows that count nothing, equals one
    process's; training after it still matches (test_pipeline_matches_one_process's steps 3-4)."""
    for name in EVALUATED:
        got, ref = results[procs][name]["eval_loss"], results["one"][name]["eval_loss"]
        assert ref is not None and got is not None and abs(got - ref) < TOL, (got, ref)


def test_stages_hold_only_their_blocks(results):
    """The uneven split: stage 0 holds blocks 0-2 and the embeddings, stage 1 block 3, the norm and the head."""
    first, last = (set(results["grads"]["uneven"]["stages"][r][0]) for r in range(2))
    assert {n.split(".")[2] for n in first if n.startswith("model.layers.")} == {"0", "1", "2"}
    assert {n.split(".")[2] for n in last if n.startswith("model.layers.")} == {"3"}
    assert "model.embed_tokens.weight" in first and "lm_head.weight" in last
    assert "model.norm.weight" in last and "model.norm.weight" not in first


def test_tied_embedding_gradients_summed(results):
    """Both ends hold the tied weight; the head's gradient is the embedding's (summed over both), and
    it equals the one-process gradient of the one shared Parameter."""
    grads = results["grads"]["tied_full"]
    for step, reference in enumerate(grads["one"]):
        embed = grads["stages"][0][step]["model.embed_tokens.weight"]
        head = grads["stages"][1][step]["lm_head.weight"]
        assert torch.equal(embed, head)
        assert float((embed - reference["model.embed_tokens.weight"]).abs().max()) < TOL


@pytest.mark.parametrize("name", TWO_BY_TWO)
def test_two_stages_by_two_replicas_match_one_process(results, name):
    """4 processes: 2 stages x 2 DDP replicas, each replica half the rows; both replicas of a stage
    hold the gradients of the whole step (DDP averaged them, the loss scaled by the 2 replicas)."""
    losses, ref = results["four"][name]["losses"], results["one"][name]["losses"]
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref, strict=True))
    diffs = [_max_grad_diff(replica) for replica in results["grads4"][name]]
    print(f"{name} 2x2: loss max abs diff {loss_diff:.2e}, grad max abs diff {max(d for d, _ in diffs):.2e}")
    assert loss_diff < TOL, (losses, ref)
    assert all(diff < TOL and compared >= STEPS * 3 for diff, compared in diffs)


def test_homelab_ft_train_runs_the_pipeline(tmp_path, tiny_model_dir):
    """`homelab-ft train` with sharding.pipeline_stages: 2, as a user runs it: the parent plans and
    checks, its torchrun workers train the 2 stages; a refused split stops the parent in one line."""
    import build_recipe
    from procs import homelab_ft_here

    def train(recipe: Path, run: Path):
        return homelab_ft_here(["train", str(recipe), "--run-dir", str(run)])

    write_chat_data(tmp_path / "train.jsonl", 16)
    body = build_recipe.tiny_run(tiny_model_dir, lora={"alpha": None}, data={"max_length": 96},
                                 train={"grad_accum_steps": 2, "num_threads": 1},
                                 cluster={"gpus_per_node": 2, "device": "cpu"}, sharding={"pipeline_stages": 2})
    recipe = build_recipe.write_recipe(tmp_path / "pp.yaml", body)
    proc = train(recipe, tmp_path / "run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert (info["pipeline_stages"], info["strategy"]) == (2, "no_shard")
    assert "pipeline stage 0 of 2: blocks 0-0 + embeddings" in proc.stdout + proc.stderr  # rank 0 logs
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines if "loss" in row] == [1, 2]

    body["sharding"]["stage_blocks"] = [2, 1]
    build_recipe.write_recipe(recipe, body)
    proc = train(recipe, tmp_path / "refused")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "make them sum to 2" in proc.stderr and not (tmp_path / "refused").exists()


def _safetensors_keys(folder: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as fh:
        return set(fh.keys())


@pytest.mark.parametrize("name", RESUMED)
def test_pipelined_checkpoint_resumes_on_two_stages_and_on_one_process(results, name):
    """DCP checkpoints of the stages hold every tensor once, by the model's own names: a resume
    from step 2 gives the steps 3-4 of the uninterrupted run on 2 stages, and on one process."""
    full = results["two"][name]["losses"]
    for resumed in (results["two"][f"{name}_resume2"]["losses"], results["one"][f"{name}_resume1"]["losses"]):
        assert len(resumed) == STEPS - 2
        assert max(abs(a - b) for a, b in zip(resumed, full[2:], strict=True)) < TOL, (resumed, full)


def test_pipelined_lora_checkpoint_holds_every_stages_adapter(results):
    """The checkpoint's PEFT adapter (what export and serving read) has both stages' layers."""
    layers = {key.split(".layers.")[1].split(".")[0] for key in results["adapter_keys"] if ".layers." in key}
    assert layers == {"0", "1"}


def _logit_diff(a: Path, b: Path) -> float:
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()(input_ids=ids).logits for p in (a, b)]
    return float((logits[0] - logits[1]).abs().max())


@pytest.mark.parametrize("name", EXPORTED)
def test_export_of_a_pipelined_run_equals_the_one_process_export(results, name):
    """`export` of the pipelined run writes the one merged folder (from_pretrained loads it) whose
    logits equal the one-process run's export; the export itself checked its read-back."""
    exported = results["one"][f"{name}_export2"]
    assert exported["diff_from_base"] > 1e-3  # the trained weights, every stage's
    print(f"{name}: export logits max abs diff {results['export_logit_diff'][name]:.2e}")
    assert results["export_logit_diff"][name] < TOL
