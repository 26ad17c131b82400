"""The training loop: one loop for one device and for many ranks.

`train()` reads top to bottom: set up the run directory and processes, build the model for the
chosen rung, prepare the data, then the loop (draw micro-batches, forward, backward, clip, step,
log, evaluate, checkpoint). Sharding is applied to the model before the loop and the loop does
not care whether it is there: the only places it shows are the global token count and the
gradient-sync switch during accumulation.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from homelab_ft import logs
from homelab_ft.config import Recipe
from homelab_ft.data.pairs import collate_pairs
from homelab_ft.data.sampling import MicroBatchSampler
from homelab_ft.data.sft import collate, prepare_for
from homelab_ft.distributed import comm, parallelize
from homelab_ft.errors import Stopped
from homelab_ft.model import compiling, loading
from homelab_ft.rung import Rung, rung_for
from homelab_ft.store import checkpoint, runlock
from homelab_ft.store.rundir import init_run_dir
from homelab_ft.train import optim, preference, preflight, steps, stopping
from homelab_ft.train.loss import batch_loss_sum
from homelab_ft.train.metrics import MetricsLogger, plot_loss, progress_bar
from homelab_ft.train.offload import activations_on_host

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    step: int
    losses: list[float]
    eval_loss: float | None


def train(recipe: Recipe, *, plan=None, rung: Rung | None = None, inputs: preflight.Inputs | None = None,
          base_dir: Path | None = None) -> TrainResult:
    """Run `recipe` to `train.max_steps`.

    `rung` is what the planner decided (default: `rung_for(recipe, plan.chosen)`); `inputs` are the
    checked model folder and resume point when the caller (the CLI) already ran the checks;
    `plan` (a planner.Plan, or its dict when handed down from the torchrun parent) is stored in
    the run directory.
    """
    if rung is None:
        rung = rung_for(recipe, getattr(plan, "chosen", None))
    env = comm.setup(device_pref=recipe.train.device)
    # SIGTERM/SIGINT stop the loop after a step and save it; the handlers stay until teardown is
    # over, so torchrun's copy of the signal cannot cut short rank 0's last line.
    with stopping.StopRequest(announce=env.is_main):
        try:
            return _train(recipe, env=env, rung=rung, plan=plan, inputs=inputs, base_dir=base_dir)
        except RuntimeError:
            if env.distributed and stopping.wait_for_request(seconds=2.0):
                # A collective failed and torchrun asked us to stop: a peer rank died, and torchrun
                # reports which and why. This rank's own traceback would only bury that line.
                comm.exit_now(128 + stopping.requested())
            raise
        finally:
            runlock.release(recipe.run_dir)
            comm.teardown(env)


@dataclass
class Session:
    """Everything the loop works with, built once by `_setup`."""

    recipe: Recipe
    env: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: MicroBatchSampler
    data: object
    pad_token_id: int
    logger: MetricsLogger
    fingerprint: str
    start_step: int
    rung: Rung


def _train(recipe: Recipe, *, env, rung: Rung, plan, inputs, base_dir: Path | None) -> TrainResult:
    s = _setup(recipe, env=env, rung=rung, plan=plan, inputs=inputs, base_dir=base_dir)
    cfg = recipe.train
    losses: list[float] = []
    eval_loss = None
    progress = progress_bar(s.start_step, cfg.max_steps, enabled=env.is_main and logs.info_enabled())
    # objective: dpo swaps the batch builder, the step and the evaluation; the loop stays one loop.
    dpo = recipe.objective == "dpo"
    collate_fn, step_fn = (collate_pairs, dpo_step) if dpo else (collate, train_step)
    loop_start = time.perf_counter()
    for step in range(s.start_step + 1, cfg.max_steps + 1):
        t0 = time.perf_counter()
        micro_batches = [
            collate_fn([s.data.train[i] for i in s.sampler.next_indices()], pad_token_id=s.pad_token_id)
            for _ in range(cfg.grad_accum_steps)
        ]
        lr = s.scheduler.get_last_lr()[0]  # the rate this step uses (train_step advances the schedule)
        loss, grad_norm, trained, read, *more = step_fn(s, micro_batches)
        pair_metrics = more[0] if more else {}
        elapsed = time.perf_counter() - t0
        losses.append(loss)
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            s.logger.log(
                {
                    "step": step,
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens": read,
                    "trained_tokens": trained,
                    "tokens_per_s": read / elapsed,
                    "epoch": s.sampler.epoch,
                    "time_s": time.perf_counter() - loop_start,
                    **pair_metrics,
                }
            )
        progress.set_postfix(loss=f"{loss:.4f}", tok_s=f"{read / elapsed:.0f}", refresh=False,
                             **preference.progress_fields(pair_metrics))
        progress.update(1)

        last = step == cfg.max_steps
        if s.data.eval is not None and ((cfg.eval_every and step % cfg.eval_every == 0) or last):
            eval_metrics = {}
            if dpo:
                eval_loss, eval_metrics = evaluate_pairs(s.model, s.data.eval, env=env, recipe=recipe, pad_token_id=s.pad_token_id)
            else:
                eval_loss = evaluate(s.model, s.data.eval, env=env, recipe=recipe, pad_token_id=s.pad_token_id)
            s.logger.log({"step": step, "eval_loss": eval_loss, **eval_metrics})
            progress.write(f"step {step}: eval_loss {eval_loss:.4f}")
        # Every rank learns whether any rank was asked to stop, so all stop after the same step.
        signum = comm.all_reduce_max(stopping.requested(), env)
        save_now = (cfg.save_every and step % cfg.save_every == 0) or last or (signum and cfg.save_on_interrupt)
        if save_now:
            state = checkpoint.TrainerState(
                step=step,
                scheduler=s.scheduler.state_dict(),
                sampler=s.sampler.state_dict(),
                model_fingerprint=s.fingerprint,
                world_size=env.world_size,
            )
            checkpoint.save(recipe.run_dir, model=s.model, optimizer=s.optimizer, state=state, keep_last=cfg.keep_last)
        if signum:
            progress.close()
            s.logger.close()
            raise _stopped(recipe, env=env, step=step, signum=signum, saved=bool(save_now))
    progress.close()
    s.logger.close()
    if env.is_main and (recipe.run_dir / "metrics.jsonl").is_file():
        plot_loss(recipe.run_dir / "metrics.jsonl", recipe.run_dir / "loss.png")
        log.info("run directory: %s (metrics.jsonl, loss.png, checkpoints/)", recipe.run_dir)
    return TrainResult(run_dir=recipe.run_dir, step=cfg.max_steps, losses=losses, eval_loss=eval_loss)


def _stopped(recipe: Recipe, *, env, step: int, signum: int, saved: bool) -> Stopped:
    """The one line that ends a stopped run: where it stopped and how to continue (rank 0 says it)."""
    if not env.is_main:
        return Stopped("", signum=signum)
    latest = checkpoint.latest(recipe.run_dir)
    kept = (f"checkpoint of step {step} written" if saved
            else f"no checkpoint written (train.save_on_interrupt=false); newest: {latest.name if latest else 'none'}")
    return Stopped(
        f"{stopping.name(signum)} after step {step}; {kept}; continue with: homelab-ft train RECIPE --resume "
        f"--run-dir {recipe.run_dir}",
        signum=signum,
    )


def train_step(s: Session, micro_batches: list[dict]) -> tuple[float, float, int, int]:
    """One optimizer step over this rank's micro-batches.

    Returns the step's mean loss per trained token (all ranks), the gradient norm before
    clipping, and the trained and read token counts of all ranks.
    """
    env, model = s.env, s.model
    local_tokens = sum(steps.trained_tokens(mb["labels"]) for mb in micro_batches)
    global_tokens = int(comm.all_reduce_sum(local_tokens, env))
    scale = steps.loss_scale(world_size=env.world_size, global_tokens=global_tokens)

    model.train()
    loss_sum = torch.zeros((), device=env.device)
    for i, mb in enumerate(micro_batches):
        # Only the last micro-batch of the step reduces gradients across ranks.
        with parallelize.accumulation_sync(model, last_micro_batch=i == len(micro_batches) - 1):
            with activations_on_host(enabled=s.rung.activation_offload, pin_memory=env.device.type == "cuda"):
                summed = batch_loss_sum(model, mb, device=env.device, chunk_tokens=s.recipe.train.loss_chunk_tokens,
                                        compiled=s.recipe.train.compile)
            (summed * scale).backward()
        loss_sum += summed.detach()
    if s.recipe.train.optimizer_in_backward:  # every parameter already stepped from its gradient hook
        grad_norm = s.optimizer.grad_norm(env)
    else:
        grad_norm = comm.clip_grad_norm_(model, s.recipe.train.max_grad_norm, env)
    s.optimizer.step()
    s.scheduler.step()
    s.optimizer.zero_grad(set_to_none=True)

    loss = comm.all_reduce_sum(loss_sum, env) / max(global_tokens, 1)
    read = int(comm.all_reduce_sum(sum(steps.input_tokens(mb) for mb in micro_batches), env))
    return loss, float(grad_norm), global_tokens, read


def dpo_step(s: Session, micro_batches: list[dict]) -> tuple[float, float, int, int, dict]:
    """One optimizer step of preference tuning (objective: dpo); the arithmetic is preference.py's.

    Per micro-batch: the reference log-probabilities (no grad: the adapters disabled, or the cache),
    then one forward of the chosen + rejected rows and the backward of the pair losses scaled by
    world_size / (pairs in the step on all ranks). Returns train_step's four values and the step's
    per-pair means of preference.METRICS (all ranks).
    """
    env, model = s.env, s.model
    global_pairs = int(comm.all_reduce_sum(sum(preference.num_pairs(mb) for mb in micro_batches), env))
    scale = steps.loss_scale(world_size=env.world_size, global_tokens=global_pairs)

    model.train()
    sums = torch.zeros(len(preference.METRICS), dtype=torch.float64)
    for i, mb in enumerate(micro_batches):
        reference = preference.reference_logps(model, mb, env.device)
        with parallelize.accumulation_sync(model, last_micro_batch=i == len(micro_batches) - 1):
            policy, num_tokens = preference.policy_logps(model, mb, env.device)
            losses, stats = preference.pair_losses(policy, reference, num_tokens, s.recipe.dpo)
            (losses.sum() * scale).backward()
        sums += stats.cpu()
    grad_norm = comm.clip_grad_norm_(model, s.recipe.train.max_grad_norm, env)
    s.optimizer.step()
    s.scheduler.step()
    s.optimizer.zero_grad(set_to_none=True)

    means = (comm.all_reduce_sum_tensor(sums, env) / max(global_pairs, 1)).tolist()
    metrics = dict(zip(preference.METRICS, means, strict=True))
    trained = int(comm.all_reduce_sum(sum(steps.trained_tokens(mb["labels"]) for mb in micro_batches), env))
    read = int(comm.all_reduce_sum(sum(steps.input_tokens(mb) for mb in micro_batches), env))
    return metrics.pop("loss"), float(grad_norm), trained, read, metrics


def _setup(recipe: Recipe, *, env, rung: Rung, plan, inputs, base_dir: Path | None) -> Session:
    """Check inputs, make the run directory, build model, optimizer and data order; resume."""
    cfg = recipe.train
    run_dir = recipe.run_dir
    if env.distributed:
        comm.check_job(env, rung)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    # Every input is checked before the run directory is touched: a typo never costs a run. (The
    # CLI has normally run these checks already, before launching; direct callers get them here.)
    if inputs is None:
        inputs = preflight.check_inputs(recipe, rung=rung, device_type=env.device.type)
    model_dir = inputs.model_dir
    tokenizer = loading.load_tokenizer(recipe.model, model_dir)
    # Rank 0 tokenises first and fills the datasets cache; the other ranks then read it. (If
    # rank 0 fails here, torchrun stops the waiting ranks.)
    if not env.is_main:
        comm.barrier(env)
    data = prepare_for(recipe, tokenizer, base_dir=base_dir)
    if env.is_main:
        comm.barrier(env)
    init_run_dir(recipe, env=env, resume_from=inputs.resume_from)

    torch.manual_seed(cfg.seed)  # LoRA's A matrices are initialised from this
    model = build_model(recipe, model_dir=model_dir, rung=rung, env=env)
    if cfg.compile:  # in place, once the model is built (and sharded): compiling.py says why then
        compiling.compile_blocks(model)
    if recipe.objective == "dpo" and not rung.adapters_enabled:
        # A full fine-tune's reference: scored now, with the starting weights (before a resume loads
        # a checkpoint), or read from the cache a previous run wrote.
        from homelab_ft.train.reference_cache import attach_reference

        data = attach_reference(data, model, env=env, recipe=recipe, model_dir=model_dir, pad_token_id=tokenizer.pad_token_id,
                                dtype=loading.resolve_dtype(recipe.model.dtype, env.device))
    trainable, total = loading.count_params(model)
    optimizer = optim.build_optimizer(model, cfg)
    scheduler = optim.build_scheduler(optimizer, cfg)
    sampler = MicroBatchSampler(
        len(data.train),
        micro_batch_size=cfg.micro_batch_size,
        seed=cfg.seed,
        rank=env.rank,
        world_size=env.world_size,
        shuffle=recipe.data.shuffle,
    )
    fingerprint = f"{rung.method}:{recipe.model.path}:{total}" + (":dpo" if recipe.objective == "dpo" else "")
    if env.is_main:
        info = {**rung.to_dict(), "model_dir": str(model_dir), "world_size": env.world_size, "params": total}
        (run_dir / "run.json").write_text(json.dumps(info, indent=1))
        if plan is not None:
            plan_dict = plan if isinstance(plan, dict) else plan.to_dict()
            (run_dir / "plan.json").write_text(json.dumps(plan_dict, indent=2))
    logger = MetricsLogger(run_dir, enabled=env.is_main, tensorboard=recipe.output.tensorboard)
    start = 0
    if inputs.resume_from is not None:
        state = checkpoint.load(inputs.resume_from, model=model, optimizer=optimizer, model_fingerprint=fingerprint)
        scheduler.load_state_dict(state.scheduler)
        sampler.load_state_dict(state.sampler)
        start = state.step
    if cfg.resume:  # also with no checkpoint: rows of a run killed before its first save go
        logger.truncate_after(start)
    log.info(data.report.summary())
    log.info("%s (%s): %s trainable of %s parameters on %d x %s; %d training rows; steps %d..%d",
             rung.method, rung.strategy, f"{trainable:,}", f"{total:,}", env.world_size, env.device.type,
             len(data.train), start + 1, cfg.max_steps)
    return Session(recipe, env, model, optimizer, scheduler, sampler, data, tokenizer.pad_token_id, logger, fingerprint, start, rung)


def build_model(recipe: Recipe, *, model_dir: Path, rung: Rung, env):
    """Load the base for the rung, attach adapters, apply sharding when there are several ranks."""
    dtype = loading.resolve_dtype(recipe.model.dtype, env.device)
    cfg = recipe.train
    if rung.fsdp_enabled and rung.quantized_enabled:
        from homelab_ft.distributed import sharded_qlora

        return sharded_qlora.build(recipe, model_dir=model_dir, rung=rung, env=env)
    if rung.fsdp_enabled:
        return _build_sharded(recipe, model_dir=model_dir, rung=rung, env=env, dtype=dtype)
    if rung.quantized_enabled:
        from homelab_ft.model import quant

        model = loading.load_model(
            recipe.model,
            model_dir,
            dtype=quant.compute_dtype(recipe.quant, device=env.device),
            device=env.device,
            quantization_config=quant.bnb_config(recipe.quant, device=env.device),
        )
        quant.after_load(model)
        model = quant.prepare_for_training(model, activation_checkpointing=rung.activation_checkpointing)
    else:
        model = loading.load_model(recipe.model, model_dir, dtype=dtype, device=env.device)
    if rung.activation_checkpointing and not env.distributed and not rung.quantized_enabled:
        model.activation_checkpointing_enable()
    if rung.adapters_enabled:
        compute = dtype
        if rung.quantized_enabled:
            from homelab_ft.model import quant

            compute = quant.compute_dtype(recipe.quant, device=env.device)
        model = loading.attach_lora(model, recipe.lora, compute_dtype=compute)
    if rung.quantized_enabled:
        from homelab_ft.distributed import sharded_qlora

        # the adapters' init from the seed alone, as the sharded 4-bit build must do it: every
        # QLoRA rung starts from the same adapters (parity of 1 process, DDP and FSDP)
        sharded_qlora.reset_adapters(model, seed=cfg.seed)
    if env.distributed:
        # Replicas (DDP) over the trainable parameters: only adapter (or full) gradients are reduced.
        model = parallelize.parallelize(
            model,
            env,
            rung=rung,
            param_dtype=dtype if recipe.sharding.param_dtype == "auto" else getattr(torch, recipe.sharding.param_dtype),
            reduce_dtype=getattr(torch, recipe.sharding.reduce_dtype),
            activation_checkpointing=rung.activation_checkpointing,
        )
    return model


def _build_sharded(recipe: Recipe, *, model_dir: Path, rung: Rung, env, dtype):
    """FSDP: build on the meta device, shard, then load weights without a full copy per rank.

    Full fine-tunes read each rank's slices straight from the safetensors. LoRA takes rank 0's
    ordinary load (broadcast into the shards) so its adapter init is the one-process run's.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from homelab_ft.distributed import sharded_loading

    lora = rung.adapters_enabled

    def build():
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=recipe.model.trust_remote_code)
        config.use_cache = False
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=recipe.model.attn_implementation,
            trust_remote_code=recipe.model.trust_remote_code,
        )
        return loading.attach_lora(model, recipe.lora, compute_dtype=dtype) if lora else model

    def load_full():
        model = loading.load_model(recipe.model, model_dir, dtype=dtype, device=torch.device("cpu"))
        return loading.attach_lora(model, recipe.lora, compute_dtype=dtype) if lora else model

    return sharded_loading.build_sharded(
        env,
        build=build,
        load_full=load_full if lora else None,
        model_dir=None if lora else model_dir,
        rung=rung,
        param_dtype=dtype if recipe.sharding.param_dtype == "auto" else getattr(torch, recipe.sharding.param_dtype),
        reduce_dtype=getattr(torch, recipe.sharding.reduce_dtype),
        activation_checkpointing=rung.activation_checkpointing,
    )


@torch.no_grad()
def evaluate(model, rows, *, env, recipe: Recipe, pad_token_id: int) -> float:
    """Mean loss per trained token over the held-out split, all ranks together.

    Every rank runs the same number of forward passes (sharded forwards are collective); a rank
    with no batch left re-runs its first one and counts nothing from it.
    """
    model.eval()
    loss_sum = torch.zeros((), device=env.device)
    tokens = 0
    for indices, real in _eval_batches(len(rows), recipe=recipe, env=env):
        mb = collate([rows[i] for i in indices], pad_token_id=pad_token_id)
        summed = batch_loss_sum(model, mb, device=env.device, chunk_tokens=recipe.train.loss_chunk_tokens,
                                compiled=recipe.train.compile)
        if real:
            loss_sum += summed
            tokens += steps.trained_tokens(mb["labels"])
    parallelize.reshard(model)
    total_tokens = comm.all_reduce_sum(tokens, env)
    return comm.all_reduce_sum(loss_sum, env) / max(total_tokens, 1)


@torch.no_grad()
def evaluate_pairs(model, rows, *, env, recipe: Recipe, pad_token_id: int) -> tuple[float, dict]:
    """Mean DPO loss per held-out pair and the means of the other preference.METRICS (`eval_` keys),
    all ranks together, with evaluate's batch schedule (every rank runs the same forwards)."""
    model.eval()
    sums = torch.zeros(len(preference.METRICS), dtype=torch.float64)
    pairs = 0
    for indices, real in _eval_batches(len(rows), recipe=recipe, env=env):
        mb = collate_pairs([rows[i] for i in indices], pad_token_id=pad_token_id)
        reference = preference.reference_logps(model, mb, env.device)
        policy, num_tokens = preference.policy_logps(model, mb, env.device)
        _, stats = preference.pair_losses(policy, reference, num_tokens, recipe.dpo)
        if real:
            sums += stats.cpu()
            pairs += preference.num_pairs(mb)
    parallelize.reshard(model)  # no backward follows: free what FSDP2 left gathered
    means = (comm.all_reduce_sum_tensor(sums, env) / max(comm.all_reduce_sum(pairs, env), 1)).tolist()
    metrics = {f"eval_{k}": v for k, v in zip(preference.METRICS, means, strict=True)}
    return metrics.pop("eval_loss"), metrics


def _eval_batches(num_rows: int, *, recipe: Recipe, env):
    """(row indices, counts) for this rank's eval forwards. Every rank runs the same number of
    forwards (sharded forwards are collective); a rank with no batch left re-runs one of the
    first ones and counts nothing from it."""
    size = recipe.train.micro_batch_size
    batches = [list(range(i, min(i + size, num_rows))) for i in range(0, num_rows, size)]
    if recipe.train.eval_max_batches:
        batches = batches[: recipe.train.eval_max_batches]
    for r in range(-(-len(batches) // env.world_size)):
        index = r * env.world_size + env.rank
        real = index < len(batches)
        yield batches[index if real else env.rank % len(batches)], real
