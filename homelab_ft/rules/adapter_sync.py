"""The dtype a rollout node's adapters cross the link in: the rule the trainer and the rollout rank
run (train/rollout_node.py) and the planner prices (plan/price/memory.py's rollout sync), written once.

The rollout rank only generates: its adapters feed the LoRA path of a base that computes in the
compute dtype, so the trainer's fp32 values (PEFT's autocast_adapter_dtype) are sent, and held on
the node, rounded to that dtype when it is narrower: half the bytes on the link and on the node for
a bf16 or fp16 base (Qwen3-8B, r16 on every linear layer: 166.5 MiB -> 83.2 MiB a sync, 1.55 s ->
0.78 s on 1 GbE, the issue's "~84 MB: about 0.7 s"). The trainer keeps its fp32 values and optimizer
state. With grpo.max_staleness 1 the node's log-probs are those of the rounded adapters, the policy
that sampled, so the importance ratio compares the right two policies. Torch-free.
"""

from __future__ import annotations


def synced_bytes(adapter_bytes: int, compute_bytes: int) -> int:
    """Bytes per adapter value on the link (and in the rollout rank's copy): the adapters' own
    width, or the compute dtype's where it is narrower."""
    return min(adapter_bytes, compute_bytes)
