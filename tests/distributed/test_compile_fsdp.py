"""`train.compile` under FSDP2: a 2-process gloo run of the real trainer with compiled blocks and
activation checkpointing gives the eager run's losses to 1e-4, and its checkpoint keeps the
parameter names.

One torchrun launch runs both (each costs seconds to start on 2 cores). In `make test` the blocks
compile with `aot_eager`: dynamo, FSDP2's hooks left out of the graph, the checkpoint higher-order
op and AOTAutograd's joint graph, all that FSDP2 meets, without inductor's code generation, whose
numerics tests/e2e/test_compile_run.py checks in one process. The inductor variant is marked
`slow`: 150 s with an empty inductor cache on this loaded 2-core machine (70 s with a warm one). Every row is truncated to
the same 24 tokens and the loss chunks hold 23 rows, so each graph compiles once per rank, for the
shapes of tests/e2e/test_compile_run.py (inductor's cache then serves one test from the other's
work); rows of changing length would compile every graph a second time, with symbolic shapes
(~3 min on 2 cores instead of ~1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from procs import Workers, job_recipe, run_checked

TOL = 1e-4
SEQ = 24
WORDS = "the quick brown fox jumps over lazy dog answer yes no paris capital".split()


def _write_rows(path: Path, num_rows: int) -> None:
    """Plain-text rows longer than SEQ tokens: truncated, every row is SEQ tokens with SEQ - 1 trained."""
    with path.open("w") as fh:
        for i in range(num_rows):
            fh.write(json.dumps({"text": " ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(60))}) + "\n")


def _recipe(tmp: Path, model_dir: Path, name: str, *, compile: bool) -> dict:
    # LoRA's dropout stays 0 (tiny_run's default): inductor draws its own dropout masks
    return job_recipe(tmp, model_dir, name, procs=2, sharding={"strategy": "full_shard"},
                      data={"sources": [{"path": str(tmp / "train.jsonl"), "format": "text"}], "max_length": SEQ},
                      train={"max_steps": 4, "grad_accum_steps": 2, "lr": 5e-3, "loss_chunk_tokens": SEQ - 1,
                             "activation_checkpointing": True, "compile": compile})


@pytest.fixture(scope="module", params=["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def results(request, tmp_path_factory, tiny_model_dir) -> dict:
    tmp = tmp_path_factory.mktemp("compile")
    _write_rows(tmp / "train.jsonl", 32)
    jobs = [{"kind": "train", "name": "eager", "recipe": _recipe(tmp, tiny_model_dir, "eager", compile=False)},
            {"kind": "train", "name": "compiled", "recipe": _recipe(tmp, tiny_model_dir, "compiled", compile=True),
             "compile_backend": request.param}]
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"base_dir": str(tmp), "jobs": jobs}))
    run_checked(Workers(spec, tmp / "out.json", nprocs=2))
    out = json.loads((tmp / "out.json").read_text())
    out["checkpoints"] = {name: Path(tmp / "runs" / name / "checkpoints") for name in ("eager", "compiled")}
    return out


def test_compiled_fsdp2_lora_matches_eager(results):
    eager, compiled = results["eager"]["losses"], results["compiled"]["losses"]
    assert len(eager) == len(compiled) == 4
    assert max(abs(a - b) for a, b in zip(eager, compiled, strict=True)) <= TOL
    assert eager[-1] < eager[0]


def test_compiled_checkpoint_has_the_eager_names(results):
    from safetensors import safe_open

    def keys(run: Path) -> set[str]:
        newest = sorted(p for p in run.iterdir() if p.name.startswith("step_"))[-1]
        names: set[str] = set()
        for path in newest.rglob("*.safetensors"):
            with safe_open(str(path), framework="pt") as fh:
                names.update(fh.keys())
        return names

    eager, compiled = keys(results["checkpoints"]["eager"]), keys(results["checkpoints"]["compiled"])
    assert eager and compiled == eager
    assert not any("_orig_mod" in name for name in compiled)
