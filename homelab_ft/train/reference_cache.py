"""The reference model of a full fine-tune's DPO, as numbers on disk instead of a second model.

DPO compares the policy with the starting model. With adapters the starting model is the policy
with its adapters disabled, at no memory cost; a full fine-tune changes every weight, and keeping
a frozen copy would double the weights in memory (16 GB more for an 8B model in bf16). The
reference only ever enters the loss as one log-probability per answer, so a pre-pass with the
starting weights computes those once, before the first step (and before a checkpoint is loaded on
resume), and stores them beside the tokenised data: 8 bytes per pair.

The file is keyed by the tokenised data's fingerprint and the model's identity (weight files'
names, sizes and modification times, config, dtype, attention kernel), so a second run on the same
model and data, a resume, or a run on another number of ranks reads it instead of running the
pre-pass again. Under FSDP2 every rank scores a share of the batches (forwards are collective, so
every rank runs the same number; a rank with none left repeats one and keeps nothing from it) and
the shares are summed across ranks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import torch

from homelab_ft.data import collate_pairs
from homelab_ft.distributed import comm, parallelize
from homelab_ft.train import preference

log = logging.getLogger(__name__)

COLUMN = "reference_logps"
PRE_PASS_FORWARDS_PER_STEP = 1 / 3
"""A no-grad forward costs about a third of a training step's forward + backward (2x) + forward
(1x); the planner prices the pre-pass as this fraction of a step per micro-batch of pairs."""


def cache_path(data, *, recipe, model_dir: Path, dtype: torch.dtype) -> Path:
    import datasets
    from datasets.fingerprint import Hasher

    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(model_dir).iterdir()
                   if p.suffix in (".safetensors", ".bin", ".json"))
    key = Hasher.hash([
        "reference-v1", data.train._fingerprint, data.eval._fingerprint if data.eval is not None else None,
        str(Path(model_dir).resolve()), files, str(dtype), recipe.model.attn_implementation,
    ])
    root = Path(recipe.data.cache_dir) if recipe.data.cache_dir else Path(datasets.config.HF_DATASETS_CACHE) / "homelab_ft"
    return root / f"reference-{key}.safetensors"


def attach_reference(data, model, *, env, recipe, model_dir: Path, dtype: torch.dtype, pad_token_id: int):
    """`data` with a `reference_logps` column (chosen, rejected) on every split, from the cache file
    or from a pre-pass of `model`, which must still hold the starting weights."""
    from safetensors.torch import load_file, save_file

    path = cache_path(data, recipe=recipe, model_dir=model_dir, dtype=dtype)
    # Decided together: a rank that skipped the pre-pass would leave the others' forwards waiting.
    have = comm.all_reduce_sum(int(path.is_file()), env) == env.world_size
    splits = {"train": data.train, **({"eval": data.eval} if data.eval is not None else {})}
    if have:
        log.info("reference log-probabilities from %s", path)
    else:
        log.info("reference pre-pass: scoring %d pairs with the starting weights", sum(len(s) for s in splits.values()))
        scored = {name: score(model, rows, env=env, batch_pairs=recipe.train.micro_batch_size, pad_token_id=pad_token_id)
                  for name, rows in splits.items()}
        if env.local_rank == 0:  # one writer per node (nodes may not share a disk)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            save_file(scored, str(tmp), metadata={"pairs": json.dumps({k: len(v) for k, v in splits.items()})})
            os.replace(tmp, path)
        comm.barrier(env)
    loaded = load_file(str(path))
    out = {name: rows.add_column(COLUMN, loaded[name].tolist()) for name, rows in splits.items()}
    return dataclasses.replace(data, train=out["train"], eval=out.get("eval"))


@torch.no_grad()
def score(model, rows, *, env, batch_pairs: int, pad_token_id: int) -> torch.Tensor:
    """[len(rows), 2] fp32 log-probabilities (chosen, rejected) of every pair under `model`."""
    was_training = model.training
    model.eval()
    batches = [list(range(i, min(i + batch_pairs, len(rows)))) for i in range(0, len(rows), batch_pairs)]
    rounds = -(-len(batches) // env.world_size)
    out = torch.zeros(len(rows), 2, dtype=torch.float64)
    for r in range(rounds):
        index = r * env.world_size + env.rank
        real = index < len(batches)
        picked = batches[index if real else env.rank % len(batches)]
        batch = collate_pairs([rows[i] for i in picked], pad_token_id=pad_token_id)
        logps = preference.policy_logps(model, batch, env.device)[0].double().cpu()
        if real:
            out[picked] = logps.view(2, -1).T
    model.train(was_training)
    parallelize.reshard(model)
    return comm.all_reduce_sum_tensor(out, env).float()
