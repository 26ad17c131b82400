"""QLoRA's unquantizable rule, once: the threshold and what counts on each side.

Read by model/quant.py (`raise_if_unquantizable`, on a meta skeleton before loading and on the
loaded model) and by the planner (plan/ladder.py), so the two never disagree about a model.
Torch-free: the planner imports it.
"""

from __future__ import annotations

MAX_UNQUANTIZABLE_FRACTION = 0.10
"""What `quant:` can do for a model: QLoRA is refused when more than this share of the
transformer-block weights would stay in full precision (MoE experts are 3-D parameters
bitsandbytes does not touch): quant.py refuses such a model before loading it, and the planner
marks the same case. Attention/MLP `nn.Linear` layers are ~100% of a dense model's block weights
and routers ~0.01%; fused MoE experts are ~97% of Mixtral-8x7B's, where "QLoRA" would silently
load ~90 GB in bf16."""


def unquantizable_fraction(*, quantized_params: int, kept_params: int) -> float:
    """The share of the weights QLoRA prices that would stay in full precision: `kept_params` over
    `quantized_params + kept_params`; above MAX_UNQUANTIZABLE_FRACTION QLoRA is refused.

    Quantized: the weights of layers bitsandbytes replaces (`nn.Linear`, transformers' `Conv1D`).
    Kept: every other weight matrix (2-D or more) of the model, e.g. fused 3-D MoE experts, Mamba's
    convolutions. In neither: 1-D weights (norms, biases), the LM head, and every embedding table,
    the token embeddings and embedding-like ones such as Gemma 3n/4's per-layer embeddings (45% of
    the counted weights of transformers' default Gemma 4 text config): lookups, not matmuls, which transformers'
    `replace_with_bnb_linear` never quantizes.
    quant.py (`raise_if_unquantizable`) and the planner (`ladder._unquantizable_fraction`) call it.
    """
    total = quantized_params + kept_params
    return kept_params / total if total else 0.0
