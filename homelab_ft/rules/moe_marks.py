"""Which modules transformers marks as fused MoE experts, and how their projections are named.

transformers 5's `use_experts_implementation` decorator marks every fused-experts class: it sets
`has_gate` and `is_transposed` on each instance. The trainer (model/moe_experts.py), the planner
(plan/shape/derive.py) and the router rule (moe_routers.py) all read these marks, so the one reading
lives here; torch-free, since the planner must not import torch.
"""

from __future__ import annotations


def is_fused_experts(module) -> bool:
    """Whether transformers marked `module` as a fused-experts stack."""
    return hasattr(module, "has_gate") and hasattr(module, "is_transposed")


def projections(module) -> tuple[str, str]:
    """The two weight stacks of an expert: the (gated) up projection and the down projection."""
    return ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")
