"""The training loop: one loop for one device and for many ranks.

`train()` reads top to bottom: set up the run directory and processes, build the model for the
chosen rung, prepare the data, then the loop (draw micro-batches, forward, backward, clip, step,
log, evaluate, checkpoint). Sharding is applied to the model before the loop and the loop does
not care whether it is there: the only places it shows are the global token count and the
gradient-sync switch during accumulation.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from homelab_ft import checkpoint, distributed, modeling, steps
from homelab_ft.config import Recipe
from homelab_ft.data import collate, prepare_data
from homelab_ft.errors import UserError
from homelab_ft.loss import token_loss_sum
from homelab_ft.metrics import MetricsLogger, plot_loss, progress_bar
from homelab_ft.offload import activations_on_host
from homelab_ft.optim_backward import check_optimizer_in_backward
from homelab_ft.rundir import check_run_dir, init_run_dir
from homelab_ft.sampling import MicroBatchSampler


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    step: int
    losses: list[float]
    eval_loss: float | None


@dataclass(frozen=True)
class Rung:
    """How this run trains: the planner's choice where the recipe left it open."""

    method: str
    strategy: str
    cpu_offload: bool


def train(recipe: Recipe, *, plan=None, base_dir: Path | None = None) -> TrainResult:
    """Run `recipe` to `train.max_steps`. `plan` (planner.Plan) resolves `auto` choices."""
    rung = resolve_rung(recipe, plan)
    env = distributed.setup(device_pref=recipe.train.device)
    try:
        return _train(recipe, env=env, rung=rung, plan=plan, base_dir=base_dir)
    finally:
        distributed.teardown(env)


def resolve_rung(recipe: Recipe, plan=None) -> Rung:
    """The recipe's explicit choices win; `auto` takes the plan's, else LoRA replicated per rank
    (the rung that trains any model that loads in full precision)."""
    chosen = plan.chosen if plan is not None else None
    method = recipe.method if recipe.method != "auto" else (chosen.method if chosen else "lora")
    if recipe.sharding.strategy != "auto":
        strategy = recipe.sharding.strategy
    elif chosen is not None and chosen.method == method:
        strategy = chosen.strategy
    else:
        # adapters are small: replicate them, so only adapter gradients cross the network
        strategy = "no_shard" if method in ("lora", "qlora") else "full_shard"
    offload = recipe.sharding.cpu_offload or bool(chosen and chosen.method == method and chosen.cpu_offload)
    return Rung(method=method, strategy=strategy, cpu_offload=offload)


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


def _train(recipe: Recipe, *, env, rung: Rung, plan, base_dir: Path | None) -> TrainResult:
    s = _setup(recipe, env=env, rung=rung, plan=plan, base_dir=base_dir)
    cfg = recipe.train
    losses: list[float] = []
    eval_loss = None
    progress = progress_bar(s.start_step, cfg.max_steps, enabled=env.is_main)
    loop_start = time.perf_counter()
    for step in range(s.start_step + 1, cfg.max_steps + 1):
        t0 = time.perf_counter()
        micro_batches = [
            collate([s.data.train[i] for i in s.sampler.next_indices()], pad_token_id=s.pad_token_id)
            for _ in range(cfg.grad_accum_steps)
        ]
        loss, grad_norm, trained, read = train_step(s, micro_batches)
        elapsed = time.perf_counter() - t0
        losses.append(loss)
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            s.logger.log(
                {
                    "step": step,
                    "loss": loss,
                    "lr": s.scheduler.get_last_lr()[0],
                    "grad_norm": grad_norm,
                    "tokens": read,
                    "trained_tokens": trained,
                    "tokens_per_s": read / elapsed,
                    "epoch": s.sampler.epoch,
                    "time_s": time.perf_counter() - loop_start,
                }
            )
        progress.set_postfix(loss=f"{loss:.4f}", tok_s=f"{read / elapsed:.0f}", refresh=False)
        progress.update(1)

        last = step == cfg.max_steps
        if s.data.eval is not None and ((cfg.eval_every and step % cfg.eval_every == 0) or last):
            eval_loss = evaluate(s.model, s.data.eval, env=env, recipe=recipe, pad_token_id=s.pad_token_id)
            s.logger.log({"step": step, "eval_loss": eval_loss})
            progress.write(f"step {step}: eval_loss {eval_loss:.4f}")
        if (cfg.save_every and step % cfg.save_every == 0) or last:
            state = checkpoint.TrainerState(
                step=step,
                scheduler=s.scheduler.state_dict(),
                sampler=s.sampler.state_dict(),
                model_fingerprint=s.fingerprint,
                world_size=env.world_size,
            )
            checkpoint.save(recipe.run_dir, model=s.model, optimizer=s.optimizer, state=state, keep_last=cfg.keep_last)
    progress.close()
    s.logger.close()
    if env.is_main and (recipe.run_dir / "metrics.jsonl").is_file():
        plot_loss(recipe.run_dir / "metrics.jsonl", recipe.run_dir / "loss.png")
        print(f"run directory: {recipe.run_dir} (metrics.jsonl, loss.png, checkpoints/)")
    return TrainResult(run_dir=recipe.run_dir, step=cfg.max_steps, losses=losses, eval_loss=eval_loss)


def train_step(s: Session, micro_batches: list[dict]) -> tuple[float, float, int, int]:
    """One optimizer step over this rank's micro-batches.

    Returns the step's mean loss per trained token (all ranks), the gradient norm before
    clipping, and the trained and read token counts of all ranks.
    """
    env, model = s.env, s.model
    local_tokens = sum(steps.trained_tokens(mb["labels"]) for mb in micro_batches)
    global_tokens = int(distributed.all_reduce_sum(local_tokens, env))
    scale = steps.loss_scale(world_size=env.world_size, global_tokens=global_tokens)

    model.train()
    loss_sum = torch.zeros((), device=env.device)
    for i, mb in enumerate(micro_batches):
        # Only the last micro-batch of the step reduces gradients across ranks.
        with distributed.accumulation_sync(model, last_micro_batch=i == len(micro_batches) - 1):
            with activations_on_host(enabled=s.recipe.train.activation_offload, pin_memory=env.device.type == "cuda"):
                summed = token_loss_sum(model, mb, device=env.device, chunk_tokens=s.recipe.train.loss_chunk_tokens)
            (summed * scale).backward()
        loss_sum += summed.detach()
    if s.recipe.train.optimizer_in_backward:  # every parameter already stepped from its gradient hook
        grad_norm = s.optimizer.grad_norm(env)
    else:
        grad_norm = distributed.clip_grad_norm_(model, s.recipe.train.max_grad_norm, env)
    s.optimizer.step()
    s.scheduler.step()
    s.optimizer.zero_grad(set_to_none=True)

    loss = distributed.all_reduce_sum(loss_sum, env) / max(global_tokens, 1)
    read = int(distributed.all_reduce_sum(sum(steps.input_tokens(mb) for mb in micro_batches), env))
    return loss, float(grad_norm), global_tokens, read


def _setup(recipe: Recipe, *, env, rung: Rung, plan, base_dir: Path | None) -> Session:
    """Check inputs, make the run directory, build model, optimizer and data order; resume."""
    cfg = recipe.train
    run_dir = recipe.run_dir
    if env.distributed:
        distributed.check_cluster(
            world_size=env.world_size,
            num_nodes=env.num_nodes,
            recipe_nodes=recipe.cluster.nodes,
            recipe_procs_per_node=recipe.cluster.gpus_per_node,
            strategy=rung.strategy,
        )
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    # Every input is checked before the run directory is touched: a typo never costs a run.
    check_optimizer_in_backward(recipe, method=rung.method, strategy=rung.strategy, world_size=env.world_size)
    resume_from = check_run_dir(recipe)
    model_dir = modeling.resolve_model_dir(recipe.model.path)
    tokenizer = modeling.load_tokenizer(recipe.model, model_dir)
    # Rank 0 tokenises first and fills the datasets cache; the other ranks then read it. (If
    # rank 0 fails here, torchrun stops the waiting ranks.)
    if not env.is_main:
        distributed.barrier(env)
    data = prepare_data(recipe.data, tokenizer, seed=cfg.seed, base_dir=base_dir)
    if env.is_main:
        distributed.barrier(env)
    init_run_dir(recipe, env=env, resume_from=resume_from)

    torch.manual_seed(cfg.seed)  # LoRA's A matrices are initialised from this
    model = build_model(recipe, model_dir=model_dir, rung=rung, env=env)
    trainable, total = modeling.count_params(model)
    optimizer = steps.build_optimizer(model, cfg)
    scheduler = steps.build_scheduler(optimizer, cfg)
    sampler = MicroBatchSampler(
        len(data.train),
        micro_batch_size=cfg.micro_batch_size,
        seed=cfg.seed,
        rank=env.rank,
        world_size=env.world_size,
        shuffle=recipe.data.shuffle,
    )
    fingerprint = f"{rung.method}:{recipe.model.path}:{total}"
    if env.is_main:
        info = {"method": rung.method, "strategy": rung.strategy, "cpu_offload": rung.cpu_offload,
                "model_dir": str(model_dir), "world_size": env.world_size, "params": total}
        (run_dir / "run.json").write_text(json.dumps(info, indent=1))
        if plan is not None:
            (run_dir / "plan.json").write_text(plan.to_json())
    logger = MetricsLogger(run_dir, enabled=env.is_main, tensorboard=recipe.output.tensorboard)
    start = 0
    if resume_from is not None:
        state = checkpoint.load(resume_from, model=model, optimizer=optimizer, model_fingerprint=fingerprint)
        scheduler.load_state_dict(state.scheduler)
        sampler.load_state_dict(state.sampler)
        start = state.step
        logger.truncate_after(start)
    if env.is_main:
        print(data.report.summary())
        print(
            f"{rung.method} ({rung.strategy}): {trainable:,} trainable of {total:,} parameters on "
            f"{env.world_size} x {env.device.type}; {len(data.train)} training rows; steps {start + 1}..{cfg.max_steps}"
        )
    return Session(recipe, env, model, optimizer, scheduler, sampler, data, tokenizer.pad_token_id, logger, fingerprint, start)


def build_model(recipe: Recipe, *, model_dir: Path, rung: Rung, env):
    """Load the base for the rung, attach adapters, apply sharding when there are several ranks."""
    method = rung.method
    dtype = modeling.resolve_dtype(recipe.model.dtype, env.device)
    cfg = recipe.train
    if method == "qlora" and env.distributed and rung.strategy != "no_shard":
        # fully_shard cannot split bitsandbytes' packed uint8 Params4bit; FSDP-QLoRA needs a
        # 4-bit storage dtype FSDP can shard, which this trainer does not set up yet.
        raise UserError(
            f"QLoRA with sharding.strategy={rung.strategy} (the base sharded over GPUs) is not supported yet; "
            "use sharding.strategy=no_shard (each GPU holds the 4-bit base, only adapter gradients cross the "
            "network) or method=lora with sharding"
        )
    from homelab_ft import quant

    if method == "qlora":
        # Refuse what bitsandbytes cannot quantize before reading any weight.
        quant.check_quantizable(json.loads((model_dir / "config.json").read_text()), recipe.quant, device=env.device)
        model = modeling.load_model(
            recipe.model,
            model_dir,
            dtype=quant.compute_dtype(recipe.quant, device=env.device),
            device=env.device,
            quantization_config=quant.bnb_config(recipe.quant, device=env.device),
        )
        quant.after_load(model)
        model = quant.prepare_for_training(model, activation_checkpointing=cfg.activation_checkpointing)
    elif env.distributed and rung.strategy != "no_shard":
        return _build_sharded(recipe, model_dir=model_dir, rung=rung, env=env, dtype=dtype)
    else:
        model = modeling.load_model(recipe.model, model_dir, dtype=dtype, device=env.device)
    sharded = env.distributed
    if cfg.activation_checkpointing and not sharded and method != "qlora":
        model.activation_checkpointing_enable()
    if method in ("lora", "qlora"):
        compute = quant.compute_dtype(recipe.quant, device=env.device) if method == "qlora" else dtype
        model = modeling.attach_lora(model, recipe.lora, compute_dtype=compute)
    if sharded:
        model = distributed.parallelize(
            model,
            env,
            strategy=rung.strategy,
            cpu_offload=rung.cpu_offload,
            param_dtype=dtype if recipe.sharding.param_dtype == "auto" else getattr(torch, recipe.sharding.param_dtype),
            reduce_dtype=getattr(torch, recipe.sharding.reduce_dtype),
            activation_checkpointing=cfg.activation_checkpointing,
        )
    return model


def _build_sharded(recipe: Recipe, *, model_dir: Path, rung: Rung, env, dtype):
    """FSDP: build on the meta device, shard, then load weights without a full copy per rank.

    Full fine-tunes read each rank's slices straight from the safetensors. LoRA takes rank 0's
    ordinary load (broadcast into the shards) so its adapter init is the one-process run's.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from homelab_ft import sharded_loading

    lora = rung.method == "lora"

    def build():
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=recipe.model.trust_remote_code)
        config.use_cache = False
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=recipe.model.attn_implementation,
            trust_remote_code=recipe.model.trust_remote_code,
        )
        return modeling.attach_lora(model, recipe.lora, compute_dtype=dtype) if lora else model

    def load_full():
        model = modeling.load_model(recipe.model, model_dir, dtype=dtype, device=torch.device("cpu"))
        return modeling.attach_lora(model, recipe.lora, compute_dtype=dtype) if lora else model

    return sharded_loading.build_sharded(
        env,
        build=build,
        load_full=load_full if lora else None,
        model_dir=None if lora else model_dir,
        strategy=rung.strategy,
        cpu_offload=rung.cpu_offload,
        param_dtype=dtype if recipe.sharding.param_dtype == "auto" else getattr(torch, recipe.sharding.param_dtype),
        reduce_dtype=getattr(torch, recipe.sharding.reduce_dtype),
        activation_checkpointing=recipe.train.activation_checkpointing,
    )


@torch.no_grad()
def evaluate(model, rows, *, env, recipe: Recipe, pad_token_id: int) -> float:
    """Mean loss per trained token over the held-out split, all ranks together.

    Every rank runs the same number of forward passes (sharded forwards are collective); a rank
    with no batch left re-runs its first one and counts nothing from it.
    """
    model.eval()
    size = recipe.train.micro_batch_size
    batches = [list(range(i, min(i + size, len(rows)))) for i in range(0, len(rows), size)]
    if recipe.train.eval_max_batches:
        batches = batches[: recipe.train.eval_max_batches]
    rounds = -(-len(batches) // env.world_size)
    loss_sum = torch.zeros((), device=env.device)
    tokens = 0
    for r in range(rounds):
        index = r * env.world_size + env.rank
        real = index < len(batches)
        mb = collate([rows[i] for i in batches[index if real else env.rank % len(batches)]], pad_token_id=pad_token_id)
        summed = token_loss_sum(model, mb, device=env.device, chunk_tokens=recipe.train.loss_chunk_tokens)
        if real:
            loss_sum += summed
            tokens += steps.trained_tokens(mb["labels"])
    total_tokens = distributed.all_reduce_sum(tokens, env)
    return distributed.all_reduce_sum(loss_sum, env) / max(total_tokens, 1)

