"""The training loop: one loop for one device and for many ranks.

`train()` reads top to bottom: set up the run directory and processes, prepare the data, build the
model for the chosen rung (build.py) and its optimizer (optim.py), then the loop (draw
micro-batches, step, log, evaluate (evaluate.py), checkpoint). A step is one skeleton
(`_optimizer_step`: the step's divisor, clip, optimizer and schedule steps, the reduced sums) around
its objective's forwards and backwards (`train_step`, `pipeline_step`, `dpo_step`, `grpo_step`, whose
rollouts are grpo.py's), and reports a `StepResult`. Sharding is applied to the model before the loop and the loop does not care whether
it is there: the only places it shows are the global token count and the gradient-sync switch
during accumulation.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import shlex
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from homelab_ft import logs
from homelab_ft.data import collate, collate_pairs
from homelab_ft.distributed import comm, parallelize
from homelab_ft.distributed.comm import DistEnv
from homelab_ft.errors import Stopped, UserError
from homelab_ft.model_facts import ModelFacts
from homelab_ft.recipe.config import Recipe
from homelab_ft.rung import Rung, rung_for
from homelab_ft.store import checkpoint, runlock
from homelab_ft.store.layout import RunDir
from homelab_ft.train import (
    divergence,
    evaluate,
    grpo,
    preference,
    preflight,
    rollout_node,
    session,
    steps,
    stopping,
)
from homelab_ft.train.grpo_loss import policy_loss
from homelab_ft.train.loss import batch_loss_sum, completion_logprobs
from homelab_ft.train.metrics import peak_memory, plot_loss, progress_bar
from homelab_ft.train.offload import activations_on_host
from homelab_ft.train.session import Session
from homelab_ft.train.steps import StepResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    step: int
    losses: list[float]
    eval_loss: float | None
    eval_reward: float | None = None
    """objective: grpo: the last held-out reward (grpo.held_out_reward), with the one before step 1 in metrics.jsonl."""


def train(recipe: Recipe, *, plan: dict | None = None, rung: Rung | None = None,
          inputs: preflight.Inputs | None = None, base_dir: Path | None = None,
          resume_command: str | None = None) -> TrainResult:
    """Run `recipe` to `train.max_steps` (or the steps `train.num_epochs` means: steps.total_steps).

    `rung` is what the planner decided (default: `rung_for(recipe)`, the recipe's own rung); `inputs`
    are the checked model folder, resume point and model facts when the caller (the CLI) already ran
    the checks. `plan` is the planner's report in the one form every process holds it,
    `Plan.to_dict()` (what `plan --json` prints and the torchrun workers receive in their Handoff):
    the trainer stores it as plan.json and, without `inputs`, reads the model's facts from it (the
    builder's answers, model_facts.py). `resume_command`: what the stop line tells the user to run
    (the CLI knows the recipe path and the overrides); default: the run directory's own recipe.yaml
    with --resume.
    """
    if inputs is None and "facts" not in (plan or {}):
        raise AssertionError("train() needs the plan (planner.plan_for_recipe(...).to_dict()) or checked preflight.Inputs")
    rung = rung_for(recipe) if rung is None else rung
    env = comm.setup(device_pref=recipe.train.device)
    # SIGTERM/SIGINT stop the loop after a step and save it; the handlers stay until teardown is
    # over, so torchrun's copy of the signal cannot cut short rank 0's last line.
    with stopping.StopRequest(announce=env.is_main):
        try:
            if rung.rollout_node_enabled:
                return _with_rollout_node(recipe, env=env, rung=rung, plan=plan, inputs=inputs, base_dir=base_dir,
                                          resume_command=resume_command)
            return _train(recipe, env=env, rung=rung, plan=plan, inputs=inputs, base_dir=base_dir,
                          resume_command=resume_command)
        except RuntimeError:
            if env.distributed and stopping.wait_for_request(seconds=2.0):
                # A collective failed and torchrun asked us to stop: a peer rank died, and torchrun
                # reports which and why. This rank's own traceback would only bury that line.
                comm.exit_now(128 + stopping.requested())
            raise
        finally:
            runlock.release(recipe.run_dir)
            comm.teardown(env)


def _with_rollout_node(recipe: Recipe, *, env: DistEnv, rung: Rung, plan: dict | None,
                       inputs: preflight.Inputs | None, base_dir: Path | None, resume_command: str | None) -> TrainResult:
    """grpo.rollout=node (rollout_node.run): the last rank serves rollouts; rank 0 trains as one process."""
    if inputs is None:
        inputs = preflight.check_inputs(recipe, rung=rung, facts=ModelFacts.from_dict(plan["facts"]),
                                        device_type=env.device.type)

    def alone(one_env: DistEnv, one_rung: Rung, link) -> TrainResult:
        return _train(recipe, env=one_env, rung=one_rung, plan=plan, inputs=inputs, base_dir=base_dir,
                      resume_command=resume_command, link=link)

    result = rollout_node.run(recipe, env=env, rung=rung, inputs=inputs, train=alone)
    return result or TrainResult(run_dir=recipe.run_dir, step=0, losses=[], eval_loss=None)


def _train(recipe: Recipe, *, env: DistEnv, rung: Rung, plan: dict | None, inputs: preflight.Inputs | None,
           base_dir: Path | None, resume_command: str | None = None, link=None) -> TrainResult:
    s = session.setup(recipe, env=env, rung=rung, plan=plan, inputs=inputs, base_dir=base_dir, link=link)
    cfg = recipe.train
    losses: list[float] = []
    eval_loss = eval_reward = None
    progress = progress_bar(s.start_step, s.max_steps, enabled=env.is_main and logs.info_enabled())
    # objective: dpo and grpo swap the batch builder, the step and the evaluation; the loop stays one loop.
    dpo = recipe.objective == "dpo"
    rows_to_batch = functools.partial(collate, pixels=s.data.pixels)  # image rows: with their pixel inputs
    collate_fn, step_fn = (collate_pairs, kto_step if recipe.dpo.unpaired else dpo_step) if dpo else (rows_to_batch, train_step)
    if s.grpo is not None:
        collate_fn = _prompt_rows
        if s.data.eval is not None and s.start_step == 0:  # the held-out reward before any update: the baseline
            eval_reward = _evaluate(s, step=0, dpo=False, progress=progress)
    loop_start = time.perf_counter()
    skipped = 0  # non-finite steps dropped so far (train.skip_nonfinite_steps)
    for step in range(s.start_step + 1, s.max_steps + 1):
        t0 = time.perf_counter()

        def draw() -> list:
            return [collate_fn([s.data.train[i] for i in s.sampler.next_indices()], pad_token_id=s.pad_token_id)
                    for _ in range(cfg.grad_accum_steps)]

        # GRPO draws prompts only when it samples a new batch (every grpo.num_iterations steps)
        try:
            result = grpo_step(s, draw, step=step) if s.grpo is not None else step_fn(s, draw())
        except UserError:  # a reward function that failed: its line below the bar, not after it
            progress.close()
            s.logger.close()
            raise
        elapsed = time.perf_counter() - t0
        last = step == s.max_steps
        if result.nonfinite:
            skipped = _skip_or_stop(s, result, step=step, skipped=skipped, progress=progress)
        else:
            losses.append(result.loss)
        if not result.nonfinite and (step % cfg.log_every == 0 or last):
            s.logger.log({**result.row(step=step, seconds=elapsed, epoch=s.sampler.epoch,
                                       time_s=time.perf_counter() - loop_start), **peak_memory(env.device)})
        if s.grpo is not None and s.grpo.due_to_show(step, last=last):
            s.logger.log_samples(step, s.grpo.shown)
        progress.set_postfix(loss=f"{result.loss:.4f}", tok_s=f"{result.read_tokens / elapsed:.0f}", refresh=False,
                             **preference.progress_fields(result.metrics), **grpo.progress_fields(result.metrics))
        progress.update(1)
        if s.data.eval is not None and ((cfg.eval_every and step % cfg.eval_every == 0) or last):
            if s.grpo is not None:
                eval_reward = _evaluate(s, step=step, dpo=False, progress=progress)
            else:
                eval_loss = _evaluate(s, step=step, dpo=dpo, progress=progress)
        if s.samples.due(step):
            s.samples.run(s.model, step=step, env=env, logger=s.logger, progress=progress)
        # Every rank learns whether any rank was asked to stop, so all stop after the same step.
        signum = comm.all_reduce_max(stopping.requested(), env)
        save_now = (cfg.save_every and step % cfg.save_every == 0) or last or (signum and cfg.save_on_interrupt)
        if save_now:
            _save(s, step=step)
        if signum:
            progress.close()
            s.logger.close()
            raise _stopped(recipe, env=env, step=step, signum=signum, saved=bool(save_now), command=resume_command)
    progress.close()
    s.logger.close()
    layout = RunDir(recipe.run_dir)
    if env.is_main and layout.metrics_file.is_file():
        plot_loss(layout.metrics_file, layout.loss_plot)
        log.info("run directory: %s (%s, %s, %s/)", recipe.run_dir, layout.metrics_file.name, layout.loss_plot.name,
                 layout.checkpoints.name)
    return TrainResult(run_dir=recipe.run_dir, step=s.max_steps, losses=losses, eval_loss=eval_loss,
                       eval_reward=eval_reward)


def _evaluate(s: Session, *, step: int, dpo: bool, progress) -> float:
    """One held-out pass (evaluate.py) under a bar of its own (one tick per forward: the final pass
    of the DPO recipe took 29 s, longer than its training, at a silent 100%), logged with the step
    it follows."""
    shown = s.env.is_main and logs.info_enabled()

    def bar(total: int):
        return progress_bar(0, total, enabled=shown, desc=f"eval after step {step}", unit="batch", leave=False)

    if s.grpo is not None:  # the mean reward of greedy completions, not a loss
        cfg = s.recipe.train
        # as many prompts per generate as a training rollout has completions: the same memory, fewer passes
        metrics = grpo.held_out_reward(s.grpo, s.model, s.data.eval, env=s.env,
                                       batch_size=cfg.micro_batch_size * s.recipe.grpo.num_generations,
                                       max_batches=cfg.eval_max_batches, progress=bar)
        s.logger.log({"step": step, **metrics})
        progress.write(f"step {step}: eval_reward {metrics['eval_reward']:.4f}")
        return metrics["eval_reward"]
    kwargs = dict(env=s.env, recipe=s.recipe, pad_token_id=s.pad_token_id, progress=bar)
    if dpo:
        eval_loss, eval_metrics = evaluate.evaluate_pairs(s.model, s.data.eval, **kwargs)
    elif s.pipeline is not None:
        eval_loss, eval_metrics = evaluate.evaluate_pipeline(s.pipeline, s.data.eval, rung=s.rung, **kwargs), {}
    else:
        eval_loss, eval_metrics = evaluate.evaluate(s.model, s.data.eval, pixels=s.data.pixels, **kwargs), {}
    s.logger.log({"step": step, "eval_loss": eval_loss, **eval_metrics})
    progress.write(f"step {step}: eval_loss {eval_loss:.4f}")
    return eval_loss


def _skip_or_stop(s: Session, result: StepResult, *, step: int, skipped: int, progress) -> int:
    """A step that was not applied (divergence.py): skipped while train.skip_nonfinite_steps allows
    (logged, and counted in metrics.jsonl), else the run stops. Every rank holds the same result."""
    value = result.loss if result.nonfinite == "loss" else result.grad_norm
    skipped += 1
    s.logger.log({"step": step, "nonfinite": result.nonfinite, "skipped_nonfinite": skipped})
    # optimizer_in_backward: the other parameters stepped inside backward; the step cannot be skipped.
    if skipped > s.recipe.train.skip_nonfinite_steps or s.rung.optimizer_in_backward:
        progress.close()
        s.logger.close()
        raise divergence.stop(s.recipe, env=s.env, rung=s.rung, step=step, what=result.nonfinite, value=str(value),
                              skipped=skipped - 1, fp16=divergence.has_fp16(s.model, s.recipe))
    if s.env.is_main:
        progress.write(f"step {step}: non-finite {result.nonfinite} ({value}); skipped it, {skipped} of "
                       f"train.skip_nonfinite_steps={s.recipe.train.skip_nonfinite_steps}")
    return skipped


def _save(s: Session, *, step: int) -> None:
    """A checkpoint of the model, the optimizer and where the schedule and the data order stand;
    never of weights that are not finite (a finite update can still overflow them: the run stops)."""
    if not divergence.check_weights(s.model, s.env):
        s.logger.close()
        raise divergence.stop(s.recipe, env=s.env, rung=s.rung, step=step, what="weights", value="after a finite update",
                              skipped=0, fp16=divergence.has_fp16(s.model, s.recipe))
    state = checkpoint.TrainerState(
        step=step,
        scheduler=s.scheduler.state_dict(),
        sampler=s.sampler.state_dict(),
        model_fingerprint=s.fingerprint,
        world_size=s.env.world_size,
        max_steps=s.max_steps,
        data_fingerprint=s.data_fingerprint,
        built_from=s.built_from,
    )
    checkpoint.save(s.recipe.run_dir, model=s.model, optimizer=s.optimizer, state=state, keep_last=s.recipe.train.keep_last,
                    rank_state=s.grpo.state_dict(step) if s.grpo is not None else None)


def _stopped(recipe: Recipe, *, env: DistEnv, step: int, signum: int, saved: bool, command: str | None) -> Stopped:
    """The one line that ends a stopped run: where it stopped and the command that continues it
    (rank 0 says it): the CLI's, naming the recipe and overrides it ran with, else the run's own
    recipe.yaml, which holds every override already."""
    if not env.is_main:
        return Stopped("", signum=signum)
    latest = checkpoint.latest(recipe.run_dir)
    kept = (f"checkpoint of step {step} written" if saved
            else f"no checkpoint written (train.save_on_interrupt=false); newest: {latest.name if latest else 'none'}")
    command = command or f"homelab-ft train {shlex.quote(str(RunDir(recipe.run_dir).recipe_file))} --resume"
    return Stopped(f"{stopping.name(signum)} after step {step}; {kept}; continue with: {command}", signum=signum)


def train_step(s: Session, micro_batches: list[dict]) -> StepResult:
    """One optimizer step of the next-token loss over this rank's micro-batches (a pipelined rung's
    through its schedule: `pipeline_step`).

    Each micro-batch's summed loss (loss.py) is scaled by world_size / (trained tokens of the step on
    all ranks) before its backward (`_optimizer_step` says why); only the last micro-batch of the
    step reduces gradients across ranks.
    """
    if s.rung.pipeline_enabled:
        return pipeline_step(s, micro_batches)
    env, model, cfg = s.env, s.model, s.recipe.train

    def backward(scale: float) -> torch.Tensor:
        loss_sum = torch.zeros((), device=env.device)
        for i, mb in enumerate(micro_batches):
            with parallelize.accumulation_sync(model, last_micro_batch=i == len(micro_batches) - 1):
                with activations_on_host(enabled=s.rung.activation_offload, pin_memory=env.device.type == "cuda"):
                    summed = batch_loss_sum(model, mb, device=env.device, chunk_tokens=cfg.loss_chunk_tokens,
                                            compiled=cfg.compile)
                (summed * scale).backward()
            loss_sum += summed.detach()
        return loss_sum

    return _optimizer_step(s, micro_batches, backward=backward)


def pipeline_step(s: Session, micro_batches: list[dict]) -> StepResult:
    """train_step through the pipeline's schedule (distributed/pipeline.py): the same loss scale per
    micro-batch (over the replicas: the stages of one pipeline hold the same rows), the gradient
    norm over every stage; the summed loss is the last stage's (0 on the others)."""

    def backward(scale: float) -> torch.Tensor:
        return s.pipeline.step(micro_batches, scale=scale, device=s.env.device)

    return _optimizer_step(s, micro_batches, backward=backward)


def dpo_step(s: Session, micro_batches: list[dict]) -> StepResult:
    """One optimizer step of preference tuning (objective: dpo); the arithmetic is preference.py's.

    Per micro-batch: the reference log-probabilities (no grad: the adapters disabled, or the cache;
    none for the reference-free losses, ORPO and SimPO),
    then one forward of the chosen + rejected rows and the backward of the pair losses scaled by
    world_size / (pairs in the step on all ranks). Its metrics are the step's per-pair means of
    preference.METRICS (all ranks).
    """
    env, model = s.env, s.model

    def backward(scale: float) -> torch.Tensor:
        sums = torch.zeros(len(preference.METRICS), dtype=torch.float64)
        for i, mb in enumerate(micro_batches):
            reference = preference.reference_logps(model, mb, env.device) if s.recipe.dpo.needs_reference else None
            with parallelize.accumulation_sync(model, last_micro_batch=i == len(micro_batches) - 1):
                policy, num_tokens = preference.policy_logps(model, mb, env.device)
                losses, stats = preference.pair_losses(policy, reference, num_tokens, s.recipe.dpo)
                (losses.sum() * scale).backward()
            sums += stats.cpu()
        return sums

    return _optimizer_step(s, micro_batches, backward=backward, units=preference.num_pairs, names=preference.METRICS)


def kto_step(s: Session, micro_batches: list[dict]) -> StepResult:
    """One optimizer step of KTO (dpo.loss: kto); the arithmetic is preference.py's.

    First the step's reference point z0 and the completions' reference log-probabilities
    (preference.kto_pre_pass, no grad), then per micro-batch one forward of the completions and the
    backward of the KTO losses scaled by world_size / (rows in the step on all ranks). Its metrics
    are preference.KTO_METRICS.
    """
    env, model = s.env, s.model
    references, kl = preference.kto_pre_pass(model, micro_batches, env=env)

    def backward(scale: float) -> torch.Tensor:
        sums = torch.zeros(len(preference.KTO_SUMS), dtype=torch.float64)
        for i, (mb, reference) in enumerate(zip(micro_batches, references, strict=True)):
            with parallelize.accumulation_sync(model, last_micro_batch=i == len(micro_batches) - 1):
                policy, _ = preference.policy_logps(model, preference.halves(mb)[0], env.device)
                losses, stats = preference.kto_losses(policy, reference, mb["label"], kl=kl, cfg=s.recipe.dpo)
                (losses.sum() * scale).backward()
            sums += stats.cpu()
        return sums

    result = _optimizer_step(s, micro_batches, backward=backward, units=preference.num_pairs, names=preference.KTO_SUMS)
    return dataclasses.replace(result, metrics=preference.kto_metrics(result.metrics, kl=kl))


def grpo_step(s: Session, draw: Callable[[], list], *, step: int) -> StepResult:
    """One optimizer step of GRPO (objective: grpo): a new batch of rollouts when one is due
    (grpo.Grpo.roll, with `draw()`'s prompt micro-batches), then per micro-batch the completions'
    log-probs (the chunked head: no [B, T, vocab] logits), the reference's when grpo.beta > 0, and
    the backward of grpo_loss.policy_loss scaled by world_size / (the step's `grpo.units` on all
    ranks). Its metrics are the policy's (clip ratios, KL) and the rollout's (grpo.Grpo.stats)."""
    g, env, model, settings = s.grpo, s.env, s.model, s.recipe.grpo
    if g.due(step):
        g.roll(model, g.prompts_for(step, draw), step=step, env=env)
    if g.may_prefetch(step, max_steps=s.max_steps, save_every=s.recipe.train.save_every):
        g.prefetch(model, draw(), step=step + 1, env=env)  # generated on the rollout node while this step trains
    names = grpo.loss_names(settings, corrects=g.corrects)
    count = grpo.units(settings)
    chunk, temperature = s.recipe.train.loss_chunk_tokens, settings.temperature

    def backward(scale: float) -> torch.Tensor:
        sums = torch.zeros(len(names), dtype=torch.float64)
        for i, b in enumerate(g.batches):
            batch = b.batch
            reference = (grpo.reference_logps(model, batch, device=env.device, chunk_tokens=chunk, temperature=temperature)
                         if settings.beta else None)
            with parallelize.accumulation_sync(model, last_micro_batch=i == len(g.batches) - 1):
                with activations_on_host(enabled=s.rung.activation_offload, pin_memory=env.device.type == "cuda"):
                    logps = completion_logprobs(model, batch, device=env.device, chunk_tokens=chunk, temperature=temperature)
                old = None if b.old_logps is None else b.old_logps.to(env.device)
                sampled = None if b.rollout.sampling_logps is None else b.rollout.sampling_logps.to(env.device)
                loss, metrics = policy_loss(logps, old_logps=old, ref_logps=reference, mask=batch["completion_mask"].to(env.device),
                                            advantages=b.advantages.to(env.device), settings=settings, normaliser=1.0,
                                            sampling_logps=sampled)
                (loss * scale).backward()
            weight = count(batch)
            sums += torch.stack([loss.detach().double().cpu(), *(metrics[n].double().cpu() * weight for n in names[1:])])
        return sums

    start = time.perf_counter()
    result = _optimizer_step(s, [b.batch for b in g.batches], backward=backward, units=count, names=names)
    seconds = time.perf_counter() - start
    return dataclasses.replace(result, metrics={**result.metrics, **g.stats,
                                                "training_tokens_per_s": result.read_tokens / max(seconds, 1e-9)})


def _prompt_rows(rows: list[dict], *, pad_token_id: int) -> list[dict]:
    """GRPO's micro-batch before sampling: the prompt rows themselves (rollout.py pads them)."""
    return rows


def _optimizer_step(s: Session, micro_batches: list[dict], *, backward: Callable[[float], torch.Tensor],
                    units: Callable[[dict], int] | None = None, names: tuple[str, ...] = ("loss",)) -> StepResult:
    """What every step shares, around its objective's `backward(scale)`.

    The step's divisor is the `units` of its micro-batches on all ranks (trained tokens unless
    given; dpo counts pairs). `backward` runs the forwards and backwards with each micro-batch's
    summed loss times `scale` = steps.loss_scale (the data-parallel average over replicas undone,
    divided by the divisor: the mean over the whole step, however it is split over micro-batches
    and ranks) and returns this rank's sums of `names` (the loss first). Then, in this order: the
    gradient norm and clipping (`_clip`), the sums of all ranks over the divisor, the optimizer
    step unless the loss or the norm is not finite (divergence.py: both are reduced over every
    rank, so every rank decides the same; AdamW's moments never see the gradient), the schedule's
    step, the gradients dropped. A pipeline's stages all hold their replica's micro-batches, so the
    world's counts are divided by the stages.
    """
    env, rung = s.env, s.rung
    replicas, copies = (rung.data_parallel_size, rung.pipeline_stages) if rung.pipeline_enabled else (env.world_size, 1)

    def world_count(count: Callable[[dict], int]) -> int:
        return int(comm.all_reduce_sum(sum(count(mb) for mb in micro_batches), env)) // copies

    divisor = world_count(units or _trained_tokens)
    s.model.train()
    sums = backward(steps.loss_scale(world_size=replicas, global_tokens=divisor))
    grad_norm = _clip(s)
    lr = s.scheduler.get_last_lr()[0]  # the rate this step used; the scheduler's step sets the next one
    # Reduced in float64, as comm.all_reduce_sum reduces a number: the ranks' fp32 sums add without fp32 rounding.
    summed = comm.all_reduce_sum_tensor(sums.detach().to(torch.float64).reshape(-1), env).cpu()
    means = dict(zip(names, (summed / max(divisor, 1)).tolist(), strict=True))
    loss = means.pop("loss")
    bad = divergence.nonfinite(loss=loss, grad_norm=grad_norm)
    if bad is None:
        s.optimizer.step()
    with warnings.catch_warnings():  # torch warns of a schedule stepped without the optimizer: meant here
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
        s.scheduler.step()  # a skipped step still counts: a resume rebuilds the schedule from the step
    s.optimizer.zero_grad(set_to_none=True)
    trained = divisor if units is None else world_count(_trained_tokens)
    return StepResult(loss=loss, grad_norm=grad_norm, lr=lr, trained_tokens=trained,
                      read_tokens=world_count(steps.input_tokens), metrics=means, nonfinite=bad)


def _trained_tokens(batch: dict) -> int:
    if "completion_mask" in batch:  # a GRPO rollout: its completion tokens carry the loss
        return int(batch["completion_mask"].sum())
    return steps.trained_tokens(batch["labels"])


def _clip(s: Session) -> float:
    """The global gradient norm before clipping, the gradients clipped to train.max_grad_norm (<= 0:
    only measured): over every rank's shards, over a pipeline's stages, or, when every parameter
    already stepped inside backward (optim_backward.py: nothing is left to clip), as its hooks measured it."""
    if s.rung.optimizer_in_backward:
        return float(s.optimizer.grad_norm(s.env))
    if s.rung.pipeline_enabled:
        return s.pipeline.clip_grad_norm_(s.recipe.train.max_grad_norm)
    return comm.clip_grad_norm_(s.model, s.recipe.train.max_grad_norm, s.env)
