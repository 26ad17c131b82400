"""The routers of an MoE model: what `lora.train_router: true` trains in full, and what the planner prices.

One rule for the trainer (model/loading.attach_lora makes them trainable), the planner (plan/shape/derive.py
counts their parameters into the shape) and `plan`'s `lora` line, read from transformers' own module
tree, never from a list of families. transformers 5 marks every fused-experts class with
`use_experts_implementation` (it sets `has_gate` and `is_transposed` on each instance, as
model/moe_experts.py reads them). The router is the sibling of that experts module in its sparse-MoE
block whose own parameters hold the routing matrix [num_experts, hidden]: Qwen3-MoE's and Mixtral's
`mlp.gate` (`F.linear(hidden, weight)`), gpt-oss's `mlp.router` (weight and bias), DeepSeek-V3's and
GLM-4-MoE's `mlp.gate` (weight kept in fp32 by transformers). Only the router's own parameters train:
a selection-only bias that gets no gradient lives in a buffer (`e_score_correction_bias`) or a child
module (Ernie 4.5's `moe_statics`); a shared expert's projections are its children's and its gate
(Qwen2-MoE's `shared_expert_gate`, [1, hidden]) is not [num_experts, ...], so neither is a router.

Torch is never imported here: the functions read a model handed to them (a meta skeleton or the
loaded model, PEFT-wrapped or not).
"""

from __future__ import annotations

from homelab_ft.errors import UserError
from homelab_ft.rules.moe_marks import is_fused_experts

KEY = "lora.train_router"


def routers(model) -> dict[str, object]:
    """Router modules by full name, one per fused-experts module that has one."""
    modules = dict(model.named_modules())
    found = {}
    for name, module in modules.items():
        if not is_fused_experts(module):
            continue
        parent_name, _, leaf = name.rpartition(".")
        experts = _num_experts(module)
        for child_name, child in modules[parent_name].named_children():
            if child_name != leaf and experts and any(p.dim() == 2 and p.shape[0] == experts
                                                      for p in child.parameters(recurse=False)):
                found[f"{parent_name}.{child_name}" if parent_name else child_name] = child
    return found


def router_parameters(model) -> dict[str, object]:
    """The parameters `lora.train_router` trains, by full name (the routers' own, weight and bias)."""
    return {f"{name}.{pname}": p for name, module in routers(model).items()
            for pname, p in module.named_parameters(recurse=False)}


def _num_experts(module) -> int:
    """Experts of a fused-experts module: its `num_experts` (every marked class sets it from the
    config), else the first dimension of its down projection (a 3-D parameter, or moe_experts'
    packed `down_proj_4bit` [E, bytes, 1])."""
    value = getattr(module, "num_experts", None)
    if isinstance(value, int) and value > 0:
        return value
    down = getattr(module, "down_proj", None)
    down = down if down is not None else getattr(module, "down_proj_4bit", None)
    return int(down.shape[0]) if down is not None and down.dim() == 3 else 0


def refuse_dense(model: str) -> UserError:
    """The one-line refusal of `train_router: true` on a model without routers (file, field, fix)."""
    return UserError(f"{KEY}: true, but model.path {model} has no MoE router to train (no fused-experts block, "
                     f"as transformers marks them, with a [experts, hidden] gate beside it); set {KEY}: false")
