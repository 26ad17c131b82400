"""The optimizer step inside backward (`train.optimizer_in_backward`), for full fine-tunes.

A full fine-tune normally holds every parameter's gradient between backward and the optimizer
step: 2 bytes per parameter in bf16 (16 GB for an 8B model), as much as the weights. Here each
parameter has its own optimizer, stepped from the parameter's post-accumulate-grad hook the moment
its gradient is complete, and the gradient is dropped right after: at most the gradients still
being summed exist at once (under FSDP2 the hook fires on the sharded parameter after the
reduce-scatter, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py). The design follows
torchtune's `optimizer_in_bwd` (training/_optimizer_in_backward.py, Lv et al. 2023, "Full Parameter
Fine-tuning for Large Language Models with Limited Resources").

What it cannot do, refused before anything starts:
- gradient accumulation: a parameter would step after every micro-batch;
- clipping the global gradient norm: each parameter steps before the norm of all of them exists
  (the norm is still measured, from the hooks, and logged);
- DDP (`no_shard` on several ranks): DDP all-reduces gradients in buckets after autograd has
  accumulated them, so the hook would step on this rank's unreduced gradient;
- adapters (LoRA/QLoRA): their gradients are ~1% of the weights; there is nothing to save;
- skipping a non-finite step (train.skip_nonfinite_steps): each hook refuses a non-finite
  gradient of its own parameter, but the parameters that stepped before it in the same backward
  cannot be taken back, so such a step stops the run instead.

AdamW is elementwise per parameter, so one optimizer per parameter computes exactly what one
optimizer over all of them does; the parity tests compare the two.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from homelab_ft.errors import UserError


class OptimizerInBackward(torch.optim.Optimizer):
    """One optimizer per trainable parameter, stepped by the parameter's gradient hook.

    It is an `Optimizer` for the LR scheduler: its param_groups are the inner optimizers' own group
    dicts, so the scheduler's LR reaches them. `step()` and `zero_grad()` do nothing (the work
    happened in backward). Checkpoints save and load `self.optimizers` through DCP's optimizer
    state dict, keyed by parameter name like a single optimizer's, so a run can resume with or
    without this switch.
    """

    def __init__(self, model: nn.Module, *, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]):
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise UserError("nothing to train: the model has no trainable parameters")
        # `make_optimizer` (optim.make_optimizer with the recipe bound) is handed in, not imported:
        # optim.py builds this class, and one direction of import keeps the two out of a cycle.
        self.optimizers = [make_optimizer([p]) for p in params]
        self._by_param = dict(zip(params, self.optimizers, strict=True))
        self._squares: list[torch.Tensor] = []
        self._handles = [p.register_post_accumulate_grad_hook(self._step_param) for p in params]
        # Optimizer.__init__ would rebuild the groups; share the inner optimizers' dicts instead.
        self.defaults = dict(self.optimizers[0].defaults)
        self.state = {}
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizers' group dicts, looked up each time: loading a checkpoint replaces
        them (Optimizer.load_state_dict builds new dicts), and a list kept from before would leave
        the scheduler setting the LR of groups no optimizer reads any more."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    @torch.no_grad()
    def _step_param(self, param: torch.Tensor) -> None:
        grad = param.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        square = local.float().pow(2).sum() / _replicas(grad)
        self._squares.append(square)
        # A non-finite gradient (or one whose square overflows) never steps its parameter nor its
        # moments; the step's norm is then not finite and the trainer stops the run (divergence.py).
        # One device sync per parameter: the price of deciding before the step inside backward.
        if bool(torch.isfinite(square)):
            self._by_param[param].step()
        param.grad = None

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def grad_norm(self, env) -> float:
        """The global gradient norm of the step that just ran (all ranks), then reset."""
        from homelab_ft.distributed import comm

        local = torch.stack(self._squares).sum() if self._squares else torch.zeros(())
        self._squares = []
        return comm.all_reduce_sum(local, env) ** 0.5

    def state_dict(self):
        raise RuntimeError("save OptimizerInBackward through checkpoint.py (DCP over .optimizers)")

    def load_state_dict(self, state_dict) -> None:
        raise RuntimeError("load OptimizerInBackward through checkpoint.py (DCP over .optimizers)")

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _replicas(grad: torch.Tensor) -> int:
    """How many ranks hold the same local gradient (HSDP's replicate dimension), so that summing
    squares over all ranks counts each shard once."""
    placements = getattr(grad, "placements", None)
    if placements is None:
        return 1
    mesh = grad.device_mesh
    count = 1
    for dim, placement in enumerate(placements):
        if placement.is_replicate():
            count *= mesh.size(dim)
    return count
