"""A run's session: everything the training loop works with, built once before the first step.

`setup` checks the inputs, prepares the data, makes the run directory and starts its trackers, then
builds the model for the rung (build.py), its optimizer and schedule, and restores a checkpoint on
resume. A run that cannot start a tracker leaves no folder behind (store/rundir.discard).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from homelab_ft.data import PreparedData, prepare_for
from homelab_ft.data.sampling import MicroBatchSampler
from homelab_ft.distributed import comm
from homelab_ft.distributed.comm import DistEnv
from homelab_ft.distributed.pipeline import Pipeline
from homelab_ft.errors import UserError
from homelab_ft.model import compiling, loading
from homelab_ft.model_facts import ModelFacts
from homelab_ft.recipe.config import Recipe
from homelab_ft.rung import Rung
from homelab_ft.store import checkpoint, rundir
from homelab_ft.store.layout import RunDir, RunInfo
from homelab_ft.train import build, grpo, optim, preflight, samples, steps
from homelab_ft.train.metrics import MetricsLogger

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Session:
    """Everything the loop works with, built once by `setup` (with keywords: the fields are many)."""

    recipe: Recipe
    rung: Rung
    env: DistEnv
    model: torch.nn.Module
    """This rank's model: whole, sharded in place (FSDP2), wrapped (DDP), or its pipeline stage."""
    pipeline: Pipeline | None
    """This rank's pipeline stage and schedule when the rung is pipelined, else None."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: PreparedData
    sampler: MicroBatchSampler
    pad_token_id: int
    samples: samples.Samples
    logger: MetricsLogger
    fingerprint: str
    """What a checkpoint must have been trained on to resume here (method, model, parameters, objective)."""
    built_from: dict
    """The recipe values this model was built from (checkpoint.built_from), recorded in every checkpoint."""
    data_fingerprint: dict | None
    """What the data was (data/fingerprint.py), recorded in every checkpoint; rank 0's alone (None elsewhere)."""
    start_step: int
    max_steps: int
    """The run's optimizer steps (steps.total_steps)."""
    grpo: grpo.Grpo | None = None
    """objective: grpo: the rollout engine, the rewards and the batch being trained on (grpo.py)."""



def setup(recipe: Recipe, *, env: DistEnv, rung: Rung, plan: dict | None, inputs: preflight.Inputs | None,
           base_dir: Path | None, link=None) -> Session:
    """Check inputs, make the run directory, build model, optimizer and data order; resume. `link`:
    grpo.rollout=node's line to the rollout rank (rollout_node.py), for the GRPO engine."""
    cfg = recipe.train
    _prepare_process(env, rung=rung, num_threads=cfg.num_threads)
    # Every input is checked before the run directory is touched: a typo never costs a run. (The
    # CLI has normally run these checks already, before launching; direct callers get them here.)
    if inputs is None:
        inputs = preflight.check_inputs(recipe, rung=rung, facts=ModelFacts.from_dict(plan["facts"]),
                                        device_type=env.device.type)
    model_dir = inputs.model_dir
    tokenizer, processor = loading.load_tokenizer_and_processor(recipe.model, model_dir, images=rung.images)
    # Rank 0 alone writes trainer_state.json, so only it hashes the data (a refusal there stops all).
    data_print = preflight.check_data_unchanged(recipe, inputs, base_dir=base_dir) if env.is_main else None
    data = _prepare_data(recipe, tokenizer, env=env, base_dir=base_dir, processor=processor)
    preflight.check_image_rows(data, rung=rung, recipe=recipe, model_dir=model_dir)
    sampled = samples.for_run(recipe, tokenizer, data, base_dir=base_dir)
    replicas = rung.data_parallel_size  # rows are dealt to replicas; the stages of one pipeline read the same
    sampler = MicroBatchSampler(len(data.train), micro_batch_size=cfg.micro_batch_size, seed=cfg.seed,
                                rank=env.rank % replicas, world_size=replicas, shuffle=recipe.data.shuffle)
    max_steps = steps.total_steps(cfg, batches_per_epoch=sampler.batches_per_epoch)
    if inputs.resume_from is not None:  # the run's length is known now, before the run directory is touched
        steps.check_resume_point(cfg, start_step=checkpoint.step_of(inputs.resume_from), max_steps=max_steps)
    comm.barrier(env)  # every rank has passed its checks before the main rank writes
    anew, existed = rundir.starts_anew(recipe, resume_from=inputs.resume_from), recipe.run_dir.exists()
    if env.is_main:
        rundir.init_run_dir(recipe, resume_from=inputs.resume_from)
    comm.barrier(env)  # and no rank reads a half-made run directory
    # The trackers start first, before minutes of loading, and a run that fails to start one leaves
    # no folder behind, so the fixed command simply runs again.
    try:
        logger = MetricsLogger(recipe.run_dir, enabled=env.is_main, report_to=recipe.output.trackers,
                               project=recipe.name)
    except UserError:
        if env.is_main and anew:
            rundir.discard(recipe.run_dir, existed=existed)
        raise
    try:
        return _build(recipe, env=env, rung=rung, plan=plan, inputs=inputs, base_dir=base_dir, link=link,
                              tokenizer=tokenizer, data=data, data_print=data_print, sampled=sampled,
                              sampler=sampler, max_steps=max_steps, logger=logger)
    except BaseException:
        logger.close()
        raise


def _build(recipe: Recipe, *, env: DistEnv, rung: Rung, plan: dict | None, inputs: preflight.Inputs,
                   base_dir: Path | None, link, tokenizer, data: PreparedData, data_print: dict | None,
                   sampled, sampler: MicroBatchSampler, max_steps: int, logger: MetricsLogger) -> Session:
    """The rest of `setup`, once the run directory and its trackers exist: model, optimizer,
    resume."""
    cfg = recipe.train
    model_dir = inputs.model_dir
    torch.manual_seed(cfg.seed)  # LoRA's A matrices are initialised from this
    model, pipe = build.build_for(recipe, model_dir=model_dir, facts=inputs.facts, rung=rung, env=env,
                                  pad_token_id=tokenizer.pad_token_id)
    if cfg.compile:  # in place, once the model is built (and sharded): compiling.py says why then
        compiling.compile_blocks(model)
    if recipe.objective == "dpo" and recipe.dpo.needs_reference and not rung.adapters_enabled:
        # A full fine-tune's reference: scored now, with the starting weights (before a resume loads
        # a checkpoint), or read from the cache a previous run wrote.
        from homelab_ft.train.reference_cache import attach_reference

        data = attach_reference(data, model, env=env, recipe=recipe, model_dir=model_dir, pad_token_id=tokenizer.pad_token_id,
                                dtype=loading.resolve_dtype(recipe.model.dtype, env.device))
    trainable, total = pipe.count_params() if pipe else loading.count_params(model)  # the whole model's
    optimizer = optim.build_optimizer(model, cfg)
    fingerprint = f"{rung.method}:{recipe.model.path}:{total}" + ("" if recipe.objective == "sft" else f":{recipe.objective}")
    settings = checkpoint.built_from(recipe, method=rung.method)
    if env.is_main:
        _write_run_info(recipe.run_dir, rung=rung, plan=plan, model_dir=model_dir, world_size=env.world_size, total=total)
    start = 0
    if inputs.resume_from is not None:
        state = checkpoint.load(inputs.resume_from, model=model, optimizer=optimizer, model_fingerprint=fingerprint,
                                 settings=settings)
        sampler.load_state_dict(state.sampler)
        start = state.step
    # After the resume: the schedule of this run's length at its step, not the saved one (optim.py).
    scheduler = optim.build_scheduler(optimizer, cfg, max_steps=max_steps, start_step=start)
    if cfg.resume:  # also with no checkpoint: rows of a run killed before its first save go
        logger.truncate_after(start)
    log.info(data.report.summary())
    log.info("%s (%s): %s trainable of %s parameters on %d x %s; %d training rows; steps %d..%d%s",
             rung.method, rung.strategy, f"{trainable:,}", f"{total:,}", env.world_size, env.device.type,
             len(data.train), start + 1, max_steps,
             steps.length_note(cfg, batches_per_epoch=sampler.batches_per_epoch, world_size=env.world_size))
    rollouts = (grpo.for_run(recipe, tokenizer, env=env, base_dir=base_dir, link=link)
                if recipe.objective == "grpo" else None)
    if rollouts is not None and inputs.resume_from is not None:  # the batch a resumed step keeps training on
        rollouts.load_state_dict(checkpoint.load_rank_state(inputs.resume_from))
    return Session(recipe=recipe, rung=rung, env=env, model=model, pipeline=pipe, optimizer=optimizer,
                   scheduler=scheduler, data=data, sampler=sampler, pad_token_id=tokenizer.pad_token_id,
                   samples=sampled, logger=logger, fingerprint=fingerprint, built_from=settings, data_fingerprint=data_print,
                   start_step=start, max_steps=max_steps, grpo=rollouts)


def _prepare_process(env: DistEnv, *, rung: Rung, num_threads: int | None) -> None:
    """This process matches the job the rung describes, and uses the threads the recipe gives it."""
    if env.distributed:
        comm.check_job(env, rung)
    if num_threads:
        torch.set_num_threads(num_threads)


def _prepare_data(recipe: Recipe, tokenizer, *, env: DistEnv, base_dir: Path | None, processor=None) -> PreparedData:
    """Tokenised splits. Rank 0 tokenises first and fills the datasets cache; the other ranks then
    read it. (If rank 0 fails here, torchrun stops the waiting ranks.)"""
    if not env.is_main:
        comm.barrier(env)
    data = prepare_for(recipe, tokenizer, base_dir=base_dir, processor=processor)
    if env.is_main:
        comm.barrier(env)
    return data


def _write_run_info(run_dir: Path, *, rung: Rung, plan: dict | None, model_dir: Path, world_size: int,
                    total: int) -> None:
    """run.json (the rung and the model it trains) and plan.json (the planner's decision), rank 0's."""
    layout = RunDir(run_dir)
    layout.write_info(RunInfo(rung=rung, model_dir=str(model_dir), world_size=world_size, params=total))
    if plan is not None:
        layout.write_plan(plan)
