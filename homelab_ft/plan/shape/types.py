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


def _per_batch(coefficients: tuple[float, ...], tokens: float, images: int) -> float:
    """c + a*T + b*T^2 per image, and x*T^2 per ordered pair of images sharing one attention (see
    VisionShape), for `images` images of `tokens` image tokens each."""
    c, a, b, x = coefficients
    return max(0.0, images * (c + a * tokens + b * tokens * tokens) + x * (images * images - images) * tokens * tokens)


@dataclass(frozen=True)
class VisionShape:
    """An image-text model's vision side: its tower and projector (every child of the base model but
    the language model, rules/vision.py), measured by running it on blank images that the model's own
    image processor prepared (vision.py). What one image costs is a function of the image tokens T it
    becomes, c + a*T + b*T^2: T is what the language model's sequence carries, and the tower's work
    grows with it (patches per token fixed by the merge or pooling). Where the tower runs a batch's
    images as one sequence under a block mask (Pixtral), the mask grows with the batch's tokens
    squared: x*T^2 more per ordered pair of images. Each quantity is kept as (c, a, b, x)."""

    params: int
    """Parameters of the tower and projector: loaded beside the language model, frozen by default."""
    image_processor: str = ""
    """The image processor class the images were prepared with (the model folder's, else transformers'
    default for the family)."""
    points: tuple[tuple[int, int, int], ...] = ()
    """(height, width, image tokens) of each image measured: the tokens the vision side returned."""
    saved: tuple[tuple[int, float, float, float, float], ...] = ()
    """(activation bytes per element, c, a, b, x): bytes autograd keeps for backward when the tower
    trains (every vision parameter requiring grad)."""
    transient: tuple[tuple[int, float, float, float, float], ...] = ()
    """(activation bytes per element, c, a, b, x): the most bytes the frozen tower's no-grad forward
    holds at once (its working set, the image features it returns included)."""
    flops: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    """Forward FLOPs, as torch.utils.flop_counter counts the matmuls, convolutions and attention."""
    linears: tuple[Linear, ...] = ()
    """The vision side's nn.Linear layers by full module name: what a `lora.target_modules` entry that
    names vision layers wraps (`all-linear` never does: rules/lora_targets.py)."""
    unmeasured: str = ""
    """Why the per-image cost could not be measured (then only the weights are priced); "" when it was."""

    def saved_bytes(self, act_bytes: int, tokens: float, images: int = 1) -> float:
        """Bytes autograd keeps for `images` images of `tokens` image tokens each, the tower trained."""
        return self._of(self.saved, act_bytes, tokens, images)

    def transient_bytes(self, act_bytes: int, tokens: float, images: int = 1) -> float:
        """The frozen tower's no-grad forward's most bytes held at once for `images` images."""
        return self._of(self.transient, act_bytes, tokens, images)

    def forward_flops(self, tokens: float, images: int = 1) -> float:
        return _per_batch(self.flops, tokens, images)

    @property
    def dynamic(self) -> bool:
        """Image tokens grow with the image (Qwen2-VL, Pixtral): the measured images gave different counts."""
        return len({t for _, _, t in self.points}) > 1

    @staticmethod
    def _of(rows, act_bytes: int, tokens: float, images: int) -> float:
        coefficients = next((row[1:] for row in rows if row[0] == act_bytes), None)
        return _per_batch(coefficients, tokens, images) if coefficients else 0.0

    @classmethod
    def from_dict(cls, data: dict) -> VisionShape:
        return cls(**{**data, "points": tuple(tuple(p) for p in data["points"]),
                      "saved": tuple(tuple(r) for r in data["saved"]),
                      "transient": tuple(tuple(r) for r in data["transient"]),
                      "flops": tuple(data["flops"]), "linears": tuple(Linear(**lin) for lin in data["linears"])})


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
    vision: VisionShape | None = None
    """An image-text checkpoint's vision tower and projector, loaded beside the language model
    (rules/vision.py): their weights, and what an image costs them (vision.py); None for text models."""
    kv_elements_per_token: int = 0
    """Elements the KV cache of `generate` holds per token, summed over the layers (derive.kv_elements_per_token:
    2 x key/value heads x head dim per attention layer); x bytes per element is the rollout's KV width."""

    @property
    def vision_params(self) -> int:
        """The vision tower's and projector's parameters (0 for a text model): frozen base weights."""
        return self.vision.params if self.vision else 0

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
        vision = VisionShape.from_dict(data["vision"]) if data.get("vision") else None
        return cls(**{**data, "blocks": blocks, "notes": tuple(data["notes"]), "vision": vision})
