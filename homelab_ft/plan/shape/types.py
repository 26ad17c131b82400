"""The model's shape as data: what the planner needs to know about a model before anything is loaded.

How many parameters each part has (per decoder-block kind, the embeddings, the head), which of a
block's parameters are `nn.Linear` layers (what QLoRA quantizes, what LoRA's `all-linear` wraps),
which are stacked MoE experts, and the activation bytes each block kind keeps for backward.

Nothing here is written per family: derive.py reads it all from the model transformers builds from
the config (on the meta device), and shape_cache.py keeps it as JSON per (config, transformers
version), so planning a model seen before imports no torch. The config itself comes from
wherever the model lives: locate.locate_config. shapes.model_shape is the front door.

`ModelShape.facts` is the little of the shape that building the model asks (homelab_ft/model_facts.py).

The sums over blocks and linears (`params`, `total_params` ...) are `functools.cached_property`:
the planner reads them in every option's estimate, hundreds of thousands of times for one plan
with advice, and a frozen shape never changes. The cached value sits in the instance's __dict__
(these dataclasses have no __slots__), which equality, hashing, `dataclasses.replace` and
`to_dict` never read: they go by the fields.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from homelab_ft.model_facts import ModelFacts


@dataclass(frozen=True)
class Linear:
    """One `nn.Linear` of a block: what bitsandbytes quantizes and what LoRA can target."""

    name: str
    """Module name inside the block (self_attn.q_proj ...); `target_modules` match it by suffix."""
    in_features: int
    out_features: int
    bias: bool = False
    all_linear: bool = True
    """`all-linear` LoRA wraps it (lora_targets.wrapped_names: PEFT's set less routers and Mamba
    projections a fused kernel reads)."""

    @property
    def weight_params(self) -> int:
        return self.in_features * self.out_features

    @property
    def params(self) -> int:
        return self.weight_params + (self.out_features if self.bias else 0)


@dataclass(frozen=True)
class BlockShape:
    """One kind of decoder block (equal parameters and layer type) and how many the model stacks."""

    num_blocks: int
    linears: tuple[Linear, ...]
    other_params: int
    """Parameters neither in an nn.Linear nor in stacked experts: norms, routers, convolutions."""
    expert_params: int = 0
    """Stacked (3-D) expert tensors and their biases: plain nn.Parameters in transformers 5, which
    bitsandbytes' load leaves unquantized; model/moe_experts.py packs and adapts them."""
    active_expert_params: int = 0
    """Expert parameters one token passes through: top-k of the experts."""
    router_params: int = 0
    """The routers' own parameters (moe_routers.router_parameters: the [experts, hidden] gate, and
    gpt-oss's bias), part of `other_params`: what lora.train_router trains."""
    expert_stacks: tuple[tuple[int, int, int], ...] = ()
    """(experts, in_features, out_features) of each fused expert projection transformers marks
    (`use_experts_implementation`): what model/quant.py packs in 4 bits one expert matrix at a
    time, and `all-linear` adapts per expert (model/moe_experts.py)."""
    expert_names: tuple[str, ...] = ()
    """The name inside the block of each of `expert_stacks` (`mlp.experts.gate_up_proj`), for `plan`'s
    `lora` line."""
    kind: str = ""
    """The block's class name."""
    first_layer: int = 0
    """Index of the first block of this kind: the one whose forward was measured."""
    saved: tuple[tuple[int, float, float], ...] = ()
    """(activation bytes per element, a, b): bytes per token that autograd keeps for this block's
    backward = a + b * seq, measured for full fine-tuning (saved.py)."""
    saved_frozen: tuple[tuple[int, float, float], ...] = ()
    """The same with the base frozen, adapters aside (LoRA, QLoRA: saved.py); empty in a shape built
    by hand, which then prices LoRA from `saved`, an upper bound."""
    lora_inputs: tuple[tuple[str, ...], ...] = ()
    """Names of the linear layers that share one input the frozen block does not keep (q/k/v_proj,
    gate/up_proj): what a LoRA adapter's lora_A saves once per group it targets."""

    @functools.cached_property
    def params(self) -> int:
        return sum(lin.params for lin in self.linears) + self.other_params + self.expert_params

    @functools.cached_property
    def active_params(self) -> int:
        return self.params - self.expert_params + self.active_expert_params

    @functools.cached_property
    def expert_weight_params(self) -> int:
        """The weights of `expert_stacks` (biases and unmarked stacks not included)."""
        return sum(e * i * o for e, i, o in self.expert_stacks)

    @functools.cached_property
    def linear_weight_params(self) -> int:
        return sum(lin.weight_params for lin in self.linears)

    @functools.cached_property
    def routed_experts(self) -> int:
        """Experts each token is routed to (top-k), from what derive.py counted: active expert
        parameters are top-k / experts of them."""
        if not self.expert_stacks or not self.expert_params:
            return 0
        return round(self.active_expert_params * self.expert_stacks[0][0] / self.expert_params)

    def saved_bytes_per_token(self, act_bytes: int, seq_len: int, *, frozen: bool = False) -> float:
        """Measured bytes per token at `seq_len` in the dtype of `act_bytes` (16-bit: 2, fp32: 4),
        with every parameter trained or (`frozen`) the base frozen."""
        rows = self.saved_frozen if frozen and self.saved_frozen else self.saved
        a, b = next((a, b) for n, a, b in rows if n == act_bytes)
        return a + b * seq_len


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    blocks: tuple[BlockShape, ...]
    embedding_params: int
    """Every embedding table outside the blocks: tokens, and per-layer input embeddings (Gemma 3n/4)."""
    lm_head_params: int
    """0 when tied: the head reuses the embedding matrix (counted once, as torch does)."""
    other_root_params: int
    """The rest outside the blocks: final norm, per-layer projections, rotary or other small tables."""
    largest_param: int
    """Elements of the model's largest single parameter (the CPU optimizer step's temporaries)."""
    logit_softcapping: bool = False
    """The decoder caps logits with tanh (Gemma 2): one more vocab-sized tensor per token in the loss."""
    notes: tuple[str, ...] = ()
    """Caveats the planner repeats as warnings (e.g. a vision tower that is not counted)."""
    attn_implementation: str = "sdpa"
    """The attention implementation the activations were measured for."""
    embedding_name: str = ""
    """Module name of the input embeddings (`get_input_embeddings`, e.g. `model.embed_tokens`): what a
    `lora.target_modules` entry must match to put an adapter on them (embedding_offload.targets_embedding)."""
    vision_params: int = 0
    """An image-text checkpoint's vision tower and projector, which the causal-LM class loads beside
    the text decoder (Gemma 3; rules/vision.py): frozen, so priced as base weights only."""
    kv_elements_per_token: int = 0
    """Elements the KV cache of `generate` holds per token, summed over the layers (derive.kv_elements_per_token:
    2 x key/value heads x head dim per attention layer); x bytes per element is the rollout's KV width."""

    @property
    def final_norm_params(self) -> int:
        return self.other_root_params

    @functools.cached_property
    def root_params(self) -> int:
        """Parameters outside the decoder blocks: embeddings, final norm, LM head."""
        return self.embedding_params + self.other_root_params + self.lm_head_params

    @functools.cached_property
    def block_params(self) -> int:
        return sum(b.num_blocks * b.params for b in self.blocks)

    @functools.cached_property
    def total_params(self) -> int:
        return self.root_params + self.block_params

    @functools.cached_property
    def active_params(self) -> int:
        """Parameters one token passes through (== total_params for dense models)."""
        return self.root_params + sum(b.num_blocks * b.active_params for b in self.blocks)

    @functools.cached_property
    def max_block_params(self) -> int:
        """The largest block: what FSDP gathers at once."""
        return max(b.params for b in self.blocks)

    @functools.cached_property
    def expert_weight_params(self) -> int:
        """The weights of every block's `expert_stacks` (biases and unmarked stacks not included)."""
        return sum(b.num_blocks * b.expert_weight_params for b in self.blocks)

    @functools.cached_property
    def linear_weight_params(self) -> int:
        """Weights of the blocks' nn.Linear layers: what 4-bit/8-bit quantization replaces."""
        return sum(b.num_blocks * b.linear_weight_params for b in self.blocks)

    @functools.cached_property
    def is_moe(self) -> bool:
        return any(b.expert_params for b in self.blocks)

    @property
    def facts(self) -> ModelFacts:
        """What the builder asks, from this shape: the same meta model and the same cache entry."""
        experts = tuple(dict.fromkeys(name for b in self.blocks for name in b.expert_names))
        return ModelFacts(num_blocks=self.num_layers, vocab_size=self.vocab_size, tied_embeddings=self.tie_word_embeddings,
                          embedding_name=self.embedding_name, fused_experts=experts)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelShape:
        blocks = tuple(BlockShape(**{**b, "linears": tuple(Linear(**lin) for lin in b["linears"]),
                                     "saved": tuple(tuple(row) for row in b["saved"]),
                                     "saved_frozen": tuple(tuple(row) for row in b["saved_frozen"]),
                                     "lora_inputs": tuple(tuple(g) for g in b["lora_inputs"]),
                                     "expert_stacks": tuple(tuple(x) for x in b["expert_stacks"]),
                                     "expert_names": tuple(b.get("expert_names", ()))})
                       for b in data["blocks"])
        return cls(**{**data, "blocks": blocks, "notes": tuple(data["notes"])})
