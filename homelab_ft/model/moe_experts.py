"""Mixture-of-experts layers for QLoRA and LoRA: 4-bit experts and adapters on every expert.

transformers 5 stores a layer's experts as fused 3-D parameters (`gate_up_proj` [E, 2I, H] or,
transposed, [E, H, 2I]; `down_proj`), which bitsandbytes' `Linear4bit` never sees and PEFT's
`all-linear` never wraps: 97% of Qwen3-30B-A3B's block weights stayed in bf16 and untrained.
Which modules are such expert stacks, and how their weights are laid out, is read from
transformers itself: its `use_experts_implementation` decorator marks every fused-experts class
and records `has_gate`, `is_transposed`, `has_bias` and the gating function (`_apply_gate`) on
each instance. Nothing here names a family.

Each expert's 2-D weight is quantized on its own with bitsandbytes' functional API, so the bytes
are exactly what bitsandbytes produces for that slice (a dense `Linear4bit` of the same matrix
holds the same bytes), and stays packed. `quantize` packs a loaded module in place; the trainer
instead packs a meta-built one (`pack_meta`) and fills it expert by expert as the checkpoint is
read (`quantize_stack`, distributed/sharded_experts.py), so the experts never exist whole in the
compute dtype. The forward visits only the experts that tokens were
routed to, one at a time, through `bnb.matmul_4bit`: it dequantizes that expert's weight for the
matmul and again in backward, so neither a full-precision copy of the experts nor one expert's
dequantized weight is kept for backward. A transposed layout (gpt-oss: `x @ W[e]`) quantizes
`W[e].T`, the [out, in] matrix a `Linear4bit` would hold.

LoRA on experts: per projection, A [E, r, in] and B [E, out, r] beside the (4-bit or plain) base,
`y += dropout(x) @ A[e].T @ B[e].T * alpha / r` (alpha / sqrt(r) with rsLoRA), as PEFT's LoRA
computes for one `nn.Linear`. PEFT 0.21's `target_parameters` wraps a 3-D parameter by adding a
full [E, out, in] delta to it at every forward, which would materialise the very copy 4-bit
experts exist to avoid and cannot compose with packed weights; hence this small module.
"""

from __future__ import annotations

import math
import types

import torch
from torch import nn

from homelab_ft.errors import UserError
from homelab_ft.rules.moe_marks import is_fused_experts, projections

BLOCKSIZE = 64
"""bitsandbytes' 4-bit block size, as `Linear4bit` uses by default (QLoRA paper)."""

_STATES = "_expert_quant_states"
"""Instance attribute holding each projection's per-expert `QuantState`s."""

_SHAPES = "_expert_shapes"
"""Instance attribute: (experts, in_features, out_features) of each packed projection."""

PACKED_SUFFIX = "_4bit"
"""The packed stack of projection `<name>` is the parameter `<name>_4bit`."""


def fused_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Modules of `model` that are fused expert stacks, by name: those transformers'
    `use_experts_implementation` decorated (it sets `has_gate` on each instance) whose `down_proj`
    is a 3-D parameter or a packed 4-bit stack."""
    found = {}
    for name, module in model.named_modules():
        if not is_fused_experts(module):
            continue
        down = getattr(module, "down_proj", None)
        if (isinstance(down, nn.Parameter) and down.dim() == 3) or hasattr(module, _STATES):
            found[name] = module
    return found


def _io(module: nn.Module, name: str) -> tuple[int, int, int]:
    """(experts, in_features, out_features) of one projection, whatever its layout."""
    if hasattr(module, _SHAPES):
        return getattr(module, _SHAPES)[name]
    weight = getattr(module, name)
    experts, rows, cols = weight.shape
    return (experts, rows, cols) if module.is_transposed else (experts, cols, rows)


# --------------------------------------------------------------------------------------------
# 4-bit experts


def quantize(module: nn.Module, *, quant_type: str = "nf4", double_quant: bool = True,
             quant_storage: torch.dtype = torch.uint8) -> None:
    """Replace each expert projection's 3-D weight by its experts' packed 4-bit bytes, in place.

    The packed stack is a frozen parameter `<name>_4bit` [E, bytes, 1] (FSDP2 can shard it along
    experts); each expert's quantisation constants are a `QuantState` kept on the module.
    """
    weights = {name: getattr(module, name).detach() for name in projections(module)}
    pack_meta(module, quant_type=quant_type, double_quant=double_quant, storage_dtype=quant_storage)
    for name, weight in weights.items():
        stack, per_expert = quantize_stack(module, weight, name=name, device=weight.device)
        module._parameters[name + PACKED_SUFFIX] = nn.Parameter(stack, requires_grad=False)
        set_states(module, name, per_expert)


def pack_meta(module: nn.Module, *, quant_type: str, double_quant: bool, storage_dtype: torch.dtype,
              device: torch.device | str = "meta") -> None:
    """Swap each projection's 3-D weight for an empty packed stack `<name>_4bit` [E, n, 1] of
    `storage_dtype` (n: one expert's 4-bit bytes as storage elements) and the 4-bit forward; the
    `QuantState`s come with the bytes (`quantize_stack`). On a meta-device model this allocates
    nothing: the sharded and one-process 4-bit builds fill it from the safetensors per block."""
    shapes = {}
    for name in projections(module):
        weight = getattr(module, name)
        shapes[name] = _io(module, name)
        experts, in_features, out_features = shapes[name]
        numel = packed_elements(in_features, out_features, storage_dtype=storage_dtype)
        if numel is None:
            raise ValueError(f"{name}: {in_features} x {out_features} 4-bit bytes do not fill {storage_dtype} elements")
        module._expert_compute_dtype = weight.dtype
        del module._parameters[name]
        module.register_parameter(name + PACKED_SUFFIX, nn.Parameter(
            torch.empty(experts, numel, 1, dtype=storage_dtype, device=device), requires_grad=False))
    setattr(module, _SHAPES, shapes)
    setattr(module, _STATES, {name: [] for name in shapes})
    module._expert_quant = (quant_type, double_quant)
    _install_forward(module)


def packed_elements(in_features: int, out_features: int, *, storage_dtype: torch.dtype) -> int | None:
    """One expert's packed 4-bit bytes as elements of `storage_dtype`, or None when they do not fill
    whole elements (then the bytes cannot be viewed as that dtype)."""
    nbytes = (in_features * out_features + 1) // 2
    width = torch.empty((), dtype=storage_dtype).element_size()
    return None if nbytes % width else nbytes // width


def quantize_stack(module: nn.Module, weight: torch.Tensor, *, name: str, device: torch.device | str):
    """(packed [E, n, 1] in the module's storage dtype, one QuantState per expert) of one projection's
    3-D weight as the checkpoint holds it (any device and dtype: the host, when read from disk).

    One expert at a time goes to `device` in the compute dtype and through bitsandbytes'
    `quantize_4bit` (blocks of 64, uint8 bytes), so the bytes are bitsandbytes' own for that
    [out, in] slice, and no more than one expert's matrix in the compute dtype is made at once.
    """
    import bitsandbytes.functional as bnbf

    quant_type, double_quant = module._expert_quant
    storage = getattr(module, name + PACKED_SUFFIX).dtype
    packed, states = [], []
    for e in range(weight.shape[0]):
        matrix = weight[e].t() if module.is_transposed else weight[e]  # [out, in], as Linear4bit holds it
        matrix = matrix.to(device=device, dtype=module._expert_compute_dtype).contiguous()
        q, state = bnbf.quantize_4bit(matrix, blocksize=BLOCKSIZE, compress_statistics=double_quant,
                                      quant_type=quant_type, quant_storage=torch.uint8)
        del matrix
        packed.append(q.reshape(-1).view(storage).unsqueeze(1))
        states.append(state)
    return torch.stack(packed), states


def expert_shape(module: nn.Module, name: str) -> tuple[int, int, int]:
    """(experts, in_features, out_features) of projection `name`, packed or not."""
    return _io(module, name)


def states(module: nn.Module, name: str) -> list:
    """The per-expert QuantStates of packed projection `name`."""
    return getattr(module, _STATES)[name]


def matrix_nbytes(module: nn.Module, name: str) -> int:
    """Bytes of one expert's matrix of projection `name` in the compute dtype (what quantize_stack makes at once)."""
    _, in_features, out_features = _io(module, name)
    return in_features * out_features * torch.empty((), dtype=module._expert_compute_dtype).element_size()


def set_states(module: nn.Module, name: str, states: list) -> None:
    """The per-expert QuantStates of projection `name` (whole on every rank: each describes a whole expert)."""
    getattr(module, _STATES)[name] = states


def is_packed(module: nn.Module) -> bool:
    """Whether `module` is a fused-experts module whose projections are packed 4-bit stacks."""
    return hasattr(module, _STATES)


def dequantized(module: nn.Module, name: str, expert: int) -> torch.Tensor:
    """One expert's weight as the model's own layout holds it ([out, in], or [in, out] transposed),
    dequantized from its 4-bit bytes; the plain weight when not quantized."""
    if not hasattr(module, _STATES):
        return getattr(module, name)[expert]
    import bitsandbytes.functional as bnbf

    matrix = bnbf.dequantize_4bit(getattr(module, name + PACKED_SUFFIX)[expert], getattr(module, _STATES)[name][expert])
    return matrix.t() if module.is_transposed else matrix


def dequantized_stack(module: nn.Module, name: str) -> torch.Tensor:
    """All experts' weights of one projection as the model's own 3-D parameter holds them."""
    if not hasattr(module, _STATES):
        return getattr(module, name)
    return torch.stack([dequantized(module, name, e) for e in range(_io(module, name)[0])])


def expert_params(module: nn.Module, name: str) -> int:
    """Weights one projection of all experts represents (its logical [E, out, in]), packed or not."""
    experts, in_features, out_features = _io(module, name)
    return experts * in_features * out_features


def packed_bytes(module: nn.Module) -> int:
    """Bytes of the packed experts and their quantisation constants (for the planner's tests)."""
    total = 0
    for name in projections(module):
        total += getattr(module, name + PACKED_SUFFIX).numel() * getattr(module, name + PACKED_SUFFIX).element_size()
        for state in getattr(module, _STATES)[name]:
            total += state.absmax.numel() * state.absmax.element_size()
            if state.nested:
                total += state.state2.absmax.numel() * state.state2.absmax.element_size() + state.offset.numel() * 4
    return total


def check_shardable(model: nn.Module, *, storage_bytes: int, shard_size: int) -> None:
    """UserError, before anything is loaded, for an expert projection the packed stack cannot hold:
    one expert's 4-bit bytes must fill whole storage elements (bitsandbytes' bytes are viewed as
    that dtype), and FSDP2 splits the stack along experts, so every rank needs at least one."""
    for module_name, module in fused_experts(model).items():
        for name in projections(module):
            experts, fan_in, fan_out = expert_shape(module, name)
            nbytes = (fan_in * fan_out + 1) // 2
            if nbytes % storage_bytes:
                raise UserError(f"method=qlora with sharding: {module_name}.{name} ({fan_in} x {fan_out} per expert) packs "
                                f"into {nbytes} bytes, not a multiple of the {storage_bytes}-byte storage element; use "
                                "sharding.strategy=no_shard or method=lora")
            if experts < shard_size:
                raise UserError(f"method=qlora with sharding: {module_name} has {experts} experts, fewer than the "
                                f"{shard_size} ranks FSDP2 splits them over; use fewer processes or sharding.strategy=no_shard")


def is_packed_stack(module: nn.Module, attr: str) -> bool:
    return is_packed(module) and attr.endswith(PACKED_SUFFIX)


def checkpoint_attr(module: nn.Module, attr: str) -> str:
    """The parameter name the checkpoint (through checkpoint_keys) holds for `module.attr`: the
    fused projection for a packed stack, else `attr` itself."""
    return attr.removesuffix(PACKED_SUFFIX) if is_packed_stack(module, attr) else attr


def state_nbytes(module: nn.Module, attr: str) -> int:
    """Bytes of one projection's QuantStates (absmax, code, and the nested ones): replicated on every rank."""
    total = 0
    for state in states(module, attr.removesuffix(PACKED_SUFFIX)):
        tensors = [state.absmax, state.code]
        if state.state2 is not None:
            tensors += [state.state2.absmax, state.state2.code, state.offset]
        total += sum(_nbytes(t) for t in tensors)
    return total


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------------------------
# adapters on experts


class ExpertLora(nn.Module):
    """LoRA A [E, r, in] and B [E, out, r] for one projection of every expert, initialised as PEFT
    initialises one `nn.Linear`'s: A Kaiming-uniform (a = sqrt(5)), B zero, so training starts
    from the base model.

    Dropout: PEFT applies one dropout per adapted linear. The gate/up projection's A of all E
    experts is one fused linear [E * r, in] on the layer's shared input (`shared_a`), so one mask
    per token serves every expert of the layer, as PEFT's one mask would for that linear; the down
    projection's inputs differ per expert, so each expert's rows get their own mask (`delta`)."""

    def __init__(self, experts: int, in_features: int, out_features: int, *, r: int, alpha: float, dropout: float,
                 rslora: bool = False, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(experts, r, in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(experts, out_features, r, dtype=dtype, device=device))
        self.scaling = alpha / math.sqrt(r) if rslora else alpha / r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for e in range(self.lora_A.shape[0]):
            nn.init.kaiming_uniform_(self.lora_A.data[e], a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def shared_a(self, x: torch.Tensor) -> torch.Tensor:
        """dropout(x) @ A_e^T of every expert at once, [T, E, r], for an input all experts share:
        one matmul, E * r / (3 * top_k * intermediate) of the experts' FLOPs (2.8% for Qwen3-30B-A3B
        at r=4), keeping x once for A's gradient instead of a gathered copy per routed token."""
        experts, r, in_features = self.lora_A.shape
        xa = self.dropout(x.to(self.lora_A.dtype)) @ self.lora_A.reshape(experts * r, in_features).t()
        return xa.view(x.shape[0], experts, r)

    def delta(self, x: torch.Tensor, expert: int, *, scale: torch.Tensor | None = None,
              xa: torch.Tensor | None = None) -> torch.Tensor:
        """scaling * (dropout(x) @ A_e^T) @ B_e^T, from lora_A's r outputs `xa` when `shared_a` made
        them; `scale` [n, 1] multiplies those r outputs (the routing weight: B(A x) w = B(A(w x)))."""
        a, b = self.lora_A[expert], self.lora_B[expert]
        if xa is None:
            xa = self.dropout(x.to(a.dtype)) @ a.t()
        if scale is not None:
            xa = xa * scale.to(xa.dtype)
        return (xa @ b.t()) * self.scaling

    def merged_delta(self, expert: int) -> torch.Tensor:
        """B @ A * scaling, [out, in]: what merging adds to the expert's weight."""
        return (self.lora_B[expert] @ self.lora_A[expert]) * self.scaling


def attach_lora(module: nn.Module, *, r: int, alpha: float, dropout: float, rslora: bool = False,
                dtype: torch.dtype = torch.float32) -> None:
    """An `ExpertLora` per projection (module.expert_lora[name]); the base stays frozen."""
    device = next(module.parameters()).device
    adapters = nn.ModuleDict()
    for name in projections(module):
        experts, in_features, out_features = _io(module, name)
        adapters[name] = ExpertLora(experts, in_features, out_features, r=r, alpha=alpha, dropout=dropout,
                                    rslora=rslora, dtype=dtype, device=device)
    module.expert_lora = adapters
    for name, param in module.named_parameters():
        param.requires_grad_(name.startswith("expert_lora."))
    _install_forward(module)


def merged_delta(module: nn.Module, name: str, expert: int) -> torch.Tensor:
    """scaling * B_e @ A_e in the layout the model's own 3-D parameter holds it ([in, out] transposed)."""
    delta = module.expert_lora[name].merged_delta(expert)
    return delta.t() if module.is_transposed else delta


def merge_lora(module: nn.Module) -> None:
    """Fold the experts' adapters into the plain (not 4-bit) weights, W_e += scaling * B_e A_e, and
    drop them: the module is transformers' own again (its class forward)."""
    with torch.no_grad():
        for name in projections(module):
            weight = getattr(module, name)
            for e in range(weight.shape[0]):
                weight[e] += merged_delta(module, name, e).to(weight.dtype)
    del module.expert_lora
    if "forward" in vars(module):
        del module.forward


# --------------------------------------------------------------------------------------------
# the forward


def _install_forward(module: nn.Module) -> None:
    module.forward = types.MethodType(_experts_forward, module)


def _project(module: nn.Module, name: str, expert: int, x: torch.Tensor, *, scale: torch.Tensor | None = None,
             xa: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W_e^T (+ bias) (+ the expert's adapter) for one projection of one expert; with `scale`
    [n, 1], of (scale * x): the base's input is scaled, the bias and lora_A's r outputs are
    (W(w x) + w b + B(A x) w), so no tensor but `x` itself is kept for the scale's gradient.
    `xa`: lora_A's outputs for these rows, from `ExpertLora.shared_a`."""
    base_input = x if scale is None else x * scale.to(x.dtype)
    if hasattr(module, _STATES):
        import bitsandbytes as bnb

        packed = getattr(module, name + PACKED_SUFFIX)[expert]
        y = bnb.matmul_4bit(base_input, packed.t(), quant_state=getattr(module, _STATES)[name][expert])
    else:
        weight = getattr(module, name)[expert]
        y = base_input @ weight if module.is_transposed else nn.functional.linear(base_input, weight)
    if module.has_bias:
        bias = getattr(module, f"{name}_bias")[expert]
        y = y + (bias if scale is None else bias * scale.to(bias.dtype))
    adapters = getattr(module, "expert_lora", None)
    if adapters is not None:
        y = y + adapters[name].delta(x, expert, scale=scale, xa=xa).to(y.dtype)
    return y


def _routes(module: nn.Module, top_k_index: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, top-k positions, token indices) of every expert tokens were routed to, as transformers'
    eager loop (integrations/moe.py) finds them, less the expert-parallel sentinel E."""
    experts = _io(module, projections(module)[1])[0]
    with torch.no_grad():
        mask = nn.functional.one_hot(top_k_index, num_classes=experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    return [(expert, *torch.where(mask[expert])) for (expert,) in hit.tolist() if expert != experts]


def _shared_up_a(module: nn.Module, hidden_states: torch.Tensor, routes: list) -> list | None:
    """Each route's rows of the gate/up adapter's lora_A outputs: `shared_a` on the layer's input,
    gathered in one index (its backward is one scatter, not one full-size gradient per expert)
    and split per route; None without adapters."""
    adapters = getattr(module, "expert_lora", None)
    if adapters is None or not routes:
        return None
    xa = adapters[projections(module)[0]].shared_a(hidden_states)  # [T, E, r]
    tokens, experts, r = xa.shape
    index = torch.cat([token_idx * experts + expert for expert, _, token_idx in routes])
    return list(xa.reshape(tokens * experts, r)[index].split([len(t) for _, _, t in routes]))


def scales_down_input(module: nn.Module, dtype: torch.dtype) -> bool:
    """Whether the expert loop applies the routing weight to the down projection's input g rather
    than to its output (W(w g) + w b + B(A g) w = w (W g + b + B A g): the same sum, bias and
    adapter included), which decides what the weight's gradient keeps: g or the hidden-wide output.
    Input when g is no wider (Qwen3-30B-A3B: 768 against 2048; gpt-oss: 2880 = 2880) or the down
    adapter's lora_A keeps g itself anyway (no dropout, adapters in the activations' `dtype`:
    Mixtral's 14336-wide g with bf16 adapters); else the output (Mixtral with dropout, fp32 adapters
    or none), and always after a post-expert norm (not linear). activations.expert_loop_bytes too."""
    if getattr(module, "has_post_expert_norm", False):
        return False
    down = projections(module)[1]
    _, in_features, out_features = _io(module, down)
    if in_features <= out_features:
        return True
    adapters = getattr(module, "expert_lora", None)
    adapter = None if adapters is None else adapters[down]
    return adapter is not None and isinstance(adapter.dropout, nn.Identity) and adapter.lora_A.dtype == dtype


def _experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' eager experts loop (integrations/moe.py), one routed expert at a time, with
    each projection through `_project`, arranged to keep less for backward (three hidden-wide
    tensors fewer per routed token, 8 per token for Qwen3-30B-A3B; tests/unit/plan/test_moe_plan.py):
    - the gate/up adapter's lora_A runs once on the shared input (`_shared_up_a`), so no gathered
      hidden-wide copy per routed token is kept for A's gradient, only r-wide rows;
    - the routing weight scales the down projection's input where that keeps less
      (`scales_down_input`), else its output, as transformers does;
    - the outputs are summed by `index_put_(accumulate=True)`, which keeps only the indices, where
      `index_add_` keeps its source, the weighted output (an expert sees a token once: same sum)."""
    up_name, down_name = projections(self)
    final = torch.zeros_like(hidden_states)
    routes = _routes(self, top_k_index)
    up_a = _shared_up_a(self, hidden_states, routes)
    scale_input = scales_down_input(self, hidden_states.dtype)
    for i, (expert, top_k_pos, token_idx) in enumerate(routes):
        h = _project(self, up_name, expert, hidden_states[token_idx], xa=None if up_a is None else up_a[i])
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        weight = top_k_weights[token_idx, top_k_pos, None]
        if scale_input:
            h = _project(self, down_name, expert, h, scale=weight)
        else:
            h = _project(self, down_name, expert, h)
            if getattr(self, "has_post_expert_norm", False):
                h = self.post_expert_norm(h)
            h = h * weight
        final.index_put_((token_idx,), h.to(final.dtype), accumulate=True)
    return final
