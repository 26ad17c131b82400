"""Pipeline parallelism: this rank's stage of a Hugging Face causal LM (cut by stages.py), run by
torch.distributed.pipelining (`PipelineStage` and its `Schedule1F1B` / `ScheduleGPipe`). No
send/recv and no schedule is written here: torch runs the micro-batches, this module builds what
it runs and the few collectives around a step. The held-out pass runs the same schedule forward
only (`Pipeline.forward_only`, torch's `schedule.eval`).

The model is built whole on the meta device (no memory), cut to this rank's stage, allocated and
filled from the safetensors with this stage's tensors only. The first stage holds the input
embeddings, the last the final norm, the head and the loss (given by the trainer, so the
normalisation over trained tokens, steps.loss_scale, is the one every rung uses). Every stage runs
the decoder's own forward: its causal mask and rotary embeddings are recomputed from the same
`attention_mask`/`position_ids` on each stage (buffers, no weights), and only the hidden states
travel between stages.

Tied embeddings (SmolLM2, Llama 3.2, Qwen2.5 small): the first stage's embedding and the last
stage's head are one Parameter in the model; here each end holds its copy, both loaded from the
one tensor in the file, and after every backward their gradients are summed over a process group
of those two ranks, so both copies take the same optimizer step and stay equal (the tie is kept,
not silently dropped). The gradient norm counts the tied weight once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from homelab_ft.distributed.comm import DistEnv
from homelab_ft.distributed.stages import (
    SCHEDULE_CLASSES,
    causal_lm,
    fill_stage,
    keep_stage,
    stage_ranges,
    tied_names,
)
from homelab_ft.model.blocks import transformer_blocks
from homelab_ft.rung import Rung

if TYPE_CHECKING:  # imported when a pipeline is built (build_pipeline): most runs never load it
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# running it


class StageModule(nn.Module):
    """One stage's forward: the decoder's own forward over the blocks this stage holds; the last
    stage ends in `loss_fn(hidden, labels, head)`, the micro-batch's summed loss times `scale`.

    Every stage receives the micro-batch's `attention_mask`/`position_ids` and `labels` as keyword
    arguments (torch.distributed.pipelining hands a step's kwargs to every stage); only the hidden
    states travel between stages."""

    def __init__(self, model: nn.Module, *, first: bool, last: bool,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor, nn.Module], torch.Tensor]):
        super().__init__()
        self.model, self.first, self.last, self.loss_fn = model, first, last, loss_fn
        self.scale = 1.0
        self.sums: list[torch.Tensor] = []

    def forward(self, x, attention_mask=None, position_ids=None, labels=None):
        lm = causal_lm(self.model)
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        hidden = lm.get_decoder()(**inputs, attention_mask=attention_mask, position_ids=position_ids,
                                  use_cache=False).last_hidden_state
        if not self.last:
            return hidden
        summed = self.loss_fn(hidden, labels, lm.get_output_embeddings())
        self.sums.append(summed.detach())
        return summed * self.scale


@dataclass
class Pipeline:
    """This rank's stage, its schedule and the process groups around it."""

    stage_module: StageModule
    schedule: PipelineScheduleSingle
    """torch's Schedule1F1B or ScheduleGPipe over this rank's one stage."""
    stage_index: int
    num_stages: int
    pp_group: dist.ProcessGroup
    tied_group: dist.ProcessGroup | None
    """The first and last stage of this replica, when the model ties its embeddings."""
    pad_token_id: int
    width: int
    """Every micro-batch is padded to this many tokens (data.max_length): a stage's receive buffers
    are sized once, from the first micro-batch (PipelineStage's shape inference)."""

    @property
    def first(self) -> bool:
        return self.stage_index == 0

    @property
    def last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def step(self, micro_batches: list[dict], *, scale: float, device: torch.device) -> torch.Tensor:
        """Forward and backward of the step's micro-batches through the schedule; returns this
        stage's summed (unscaled) loss: the step's on the last stage, 0 elsewhere."""
        summed = self._run(self.schedule.step, micro_batches, scale=scale, device=device)
        self._sum_tied_grads()
        return summed

    @torch.no_grad()
    def forward_only(self, micro_batches: list[dict], *, device: torch.device) -> torch.Tensor:
        """The micro-batches' summed loss through the schedule's forwards alone (torch's
        `schedule.eval`: no backward, no activations kept for one): the held-out pass. The last
        stage's sum, 0 on the others. Exactly the schedule's number of micro-batches, each of the
        training micro-batch's rows: the stages' receive buffers are sized for those."""
        return self._run(self.schedule.eval, micro_batches, scale=1.0, device=device)

    def _run(self, run: Callable, micro_batches: list[dict], *, scale: float, device: torch.device) -> torch.Tensor:
        batch = stack(micro_batches, width=self.width, pad_token_id=self.pad_token_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        ids = batch.pop("input_ids")
        self.stage_module.scale, self.stage_module.sums = scale, []
        args = (ids,) if self.first else ()
        run(*args, target=batch["labels"] if self.last else None, return_outputs=False, **batch)
        if not self.stage_module.sums:
            return torch.zeros((), device=device)
        # The first step, and the first after switching between step and eval, also runs the stage
        # once for PipelineStage's shape inference (one more call on the first micro-batch); the
        # schedule's own calls are the last ones.
        return torch.stack(self.stage_module.sums[-len(micro_batches):]).sum()

    def _tied_weight(self) -> nn.Parameter | None:
        if self.tied_group is None:
            return None
        lm = causal_lm(self.stage_module.model)
        return (lm.get_input_embeddings() if self.first else lm.get_output_embeddings()).weight

    def _sum_tied_grads(self) -> None:
        weight = self._tied_weight()
        if weight is not None and weight.grad is not None:
            dist.all_reduce(weight.grad, op=dist.ReduceOp.SUM, group=self.tied_group)

    def count_params(self) -> tuple[int, int]:
        """(trainable, total) parameters of the whole model, over the stages (the tied weight once):
        what one process counts, so the checkpoint's model fingerprint resumes on any layout."""
        from homelab_ft.model import loading

        trainable, total = loading.count_params(self.stage_module.model)
        twin = self._tied_weight() if not self.first else None
        if twin is not None:
            trainable, total = trainable - (twin.numel() if twin.requires_grad else 0), total - twin.numel()
        device = next(self.stage_module.model.parameters()).device  # NCCL reduces only device tensors
        counts = torch.tensor([trainable, total], dtype=torch.int64, device=device)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.pp_group)
        return int(counts[0]), int(counts[1])

    def clip_grad_norm_(self, max_norm: float) -> float:
        """The gradient norm over every stage (the tied weight counted once, on the first stage),
        clipped to `max_norm` (<= 0: only measured). Replicas hold equal gradients after DDP."""
        params = [p for p in self.stage_module.model.parameters() if p.grad is not None]
        twin = self._tied_weight() if not self.first else None
        counted = [p.grad for p in params if p is not twin]
        device = params[0].grad.device if params else torch.device("cpu")
        square = torch.nn.utils.get_total_norm(counted, norm_type=2.0).square() if counted else torch.zeros((), device=device)
        square = square.to(torch.float64)
        dist.all_reduce(square, op=dist.ReduceOp.SUM, group=self.pp_group)
        total = square.sqrt().to(torch.float32)
        if max_norm > 0 and params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.to(device), foreach=None)
        return float(total)


def stack(micro_batches: list[dict], *, width: int, pad_token_id: int) -> dict:
    """The step's micro-batches padded to `width` tokens and concatenated along the batch (the
    schedule cuts them apart again, one micro-batch per chunk): input_ids with the pad token,
    labels with IGNORE_INDEX, the attention mask with 0, packed position_ids counting on (a
    segment of their own that no real token attends to, as rows.collate pads them)."""
    from homelab_ft.labels import IGNORE_INDEX

    fills = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "attention_mask": 0}
    out: dict[str, list[torch.Tensor]] = {}
    for mb in micro_batches:
        for key, value in mb.items():
            extra = width - value.size(1)
            if key == "position_ids":
                tail = torch.arange(extra, dtype=value.dtype).expand(value.size(0), extra)
            else:
                tail = value.new_full((value.size(0), extra), fills[key])
            out.setdefault(key, []).append(torch.cat([value, tail], dim=1))
    return {key: torch.cat(parts) for key, parts in out.items()}


def process_groups(env: DistEnv, rung: Rung, *, tied: bool):
    """(stage index, pipeline group, data-parallel group or None, tied group or None) of this rank.

    Ranks are stage-major (rank = stage x replicas + replica): `launch` numbers a node's ranks
    together, so with one stage per node the stages follow the hostfile and a node's ranks are
    the replicas of its stage (DDP on the fast local links, only activations cross nodes)."""
    from torch.distributed.device_mesh import init_device_mesh

    replicas = rung.data_parallel_size
    mesh = init_device_mesh(env.device.type, (rung.pipeline_stages, replicas), mesh_dim_names=("pp", "dp"))
    stage, replica = divmod(env.rank, replicas)
    tied_group = None
    if tied:
        last = (rung.pipeline_stages - 1) * replicas
        for r in range(replicas):  # every rank creates every group, in the same order
            group = dist.new_group([r, last + r])
            if r == replica and stage in (0, rung.pipeline_stages - 1):
                tied_group = group
    return stage, mesh.get_group("pp"), mesh.get_group("dp") if replicas > 1 else None, tied_group


def _whole_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage's output already is the micro-batch's scaled loss (StageModule)."""
    return output


def build_pipeline(env: DistEnv, *, rung: Rung, build: Callable[[], nn.Module], model_dir: Path, num_blocks: int,
                   loss_fn: Callable, num_micro_batches: int, pad_token_id: int, width: int,
                   adapter_seed: int = 0, activation_checkpointing: bool = False) -> tuple[nn.Module, Pipeline]:
    """This rank's stage: the whole architecture (`build`, with its adapters) on meta, cut to the
    stage (`keep_stage`: of `num_blocks`, the model's blocks as the planner counted them, the cut
    it priced), allocated, filled from the safetensors (`fill_stage`), wrapped for torch's
    schedule. Adapters take `loading.initial_adapters` of the whole model (the seed alone), so
    every stage draws the values a one-process build with `reset_adapters` holds. Returns the
    stage's model (what the optimizer and checkpoints see, by the model's own names) and the Pipeline."""
    import torch.distributed.pipelining as pipelining

    from homelab_ft.distributed.sharded_loading import meta_parameters, restore_buffers, tie_weights
    from homelab_ft.model import loading
    from homelab_ft.model.blocks import enable_activation_checkpointing

    rng = torch.get_rng_state()
    with meta_parameters():
        model = build()
    torch.set_rng_state(rng)
    tie_weights(model)
    tied = tied_names(model)
    adapters = loading.initial_adapters(model, seed=adapter_seed)
    stage, pp_group, dp_group, tied_group = process_groups(env, rung, tied=bool(tied))
    first, last = stage == 0, stage == rung.pipeline_stages - 1
    if len(transformer_blocks(model)) != num_blocks:
        raise AssertionError(f"the plan counted {num_blocks} blocks, the built model has {len(transformer_blocks(model))}")
    blocks = stage_ranges(num_blocks, rung)[stage]
    keep_stage(model, blocks=blocks, first=first, last=last)
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    model.to_empty(device=env.device)
    restore_buffers(model, buffers)
    if rung.quantized_enabled:
        _fill_4bit(model, model_dir=model_dir, adapters=adapters, device=env.device)
    else:
        fill_stage(model, model_dir=model_dir, adapters=adapters, tied=tied)
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    module = StageModule(model, first=first, last=last, loss_fn=loss_fn)
    submod = module if dp_group is None else _replicate(module, env, group=dp_group)
    torch_stage = pipelining.PipelineStage(submod, stage, rung.pipeline_stages, env.device, group=pp_group)
    schedule_cls = getattr(pipelining, SCHEDULE_CLASSES[rung.pipeline_schedule])
    # scale_grads=False: the loss is already scaled per micro-batch by steps.loss_scale.
    schedule = schedule_cls(torch_stage, n_microbatches=num_micro_batches, loss_fn=_whole_loss, scale_grads=False)
    log.info("pipeline stage %d of %d: blocks %d-%d%s%s", stage, rung.pipeline_stages, blocks.start, blocks.stop - 1,
             " + embeddings" if first else "", " + norm, head, loss" if last else "")
    return model, Pipeline(stage_module=module, schedule=schedule, stage_index=stage, num_stages=rung.pipeline_stages,
                           pp_group=pp_group, tied_group=tied_group,
                           pad_token_id=pad_token_id, width=width)


def _fill_4bit(model: nn.Module, *, model_dir: Path, adapters: dict, device: torch.device) -> None:
    """QLoRA: this stage's base read block by block and quantised as the sharded 4-bit base is
    (sharded_qlora.fill_from_safetensors: bnb's quantize_4bit, bit for bit the one-GPU load), on
    plain tensors instead of FSDP2 shards; then the stage's adapters."""
    from homelab_ft.distributed import sharded_qlora

    sharded_qlora.fill_from_safetensors(model, sharded_qlora.load_groups(model), Path(model_dir), compute_device=device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, full in adapters.items():
            if name in params:
                params[name].copy_(full.to(params[name].dtype))


def _replicate(module: nn.Module, env: DistEnv, *, group) -> nn.Module:
    """DDP over the stage's trainable parameters among the replicas of this stage (the frozen base
    and buffers are ignored: every replica read the same ones); PipelineStage runs DDP's no_sync
    for all but the last micro-batch, so one all-reduce per step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    frozen = [name for name, p in module.named_parameters() if not p.requires_grad]
    frozen += [name for name, _ in module.named_buffers()]
    DDP._set_params_and_buffers_to_ignore_for_model(module, frozen)
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DDP(module, device_ids=device_ids, process_group=group)
