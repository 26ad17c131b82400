"""Model shape from `config.json` alone: no torch, no weights.

The planner needs, before anything is loaded, how many parameters each part of the model has and
the dimensions that drive activation memory. Both follow from the config: every family supported
here builds its blocks from `nn.Linear`, RMSNorm and (for MoE) 3-D expert tensors whose sizes are
fixed by a handful of keys. The formulas mirror the module constructors of transformers 5.x
(`models/<family>/modeling_<family>.py`), and tests/unit/test_shapes.py checks them against
`sum(p.numel())` of instantiated models of every family.

The config itself comes from wherever the model lives: locate.locate_config.
"""

from __future__ import annotations

from dataclasses import dataclass

from homelab_ft.errors import UserError

# Defaults of transformers' config classes for keys a config.json may leave out (read from
# models/<family>/configuration_<family>.py of transformers 5.x). One table, so no lookup below
# invents its own fallback.
_DEFAULTS = {
    "attention_bias": False,
    "mlp_bias": False,
    "qkv_bias": True,  # Qwen2-MoE
    "tie_word_embeddings": False,
    "head_dim": None,  # None: hidden_size // num_attention_heads
    "num_key_value_heads": None,  # None: num_attention_heads (multi-head attention)
    "final_logit_softcapping": None,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "shared_expert_intermediate_size": 0,
    "max_position_embeddings": 2048,
}
# Families whose config class defaults tie_word_embeddings to True (Gemma ties its LM head).
_TIED_BY_DEFAULT = {"gemma", "gemma2", "gemma3_text"}

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3")
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED = LLAMA_LIKE + MOE + ("gemma3",)


@dataclass(frozen=True)
class Linear:
    """One `nn.Linear` per block: what bitsandbytes quantizes and what LoRA can target."""

    name: str
    """Module-name suffix as PEFT's `target_modules` matches it (q_proj, gate_up_proj ...)."""
    in_features: int
    out_features: int
    bias: bool = False

    @property
    def weight_params(self) -> int:
        return self.in_features * self.out_features

    @property
    def params(self) -> int:
        return self.weight_params + (self.out_features if self.bias else 0)


@dataclass(frozen=True)
class BlockShape:
    """One kind of decoder block and how many of them the model stacks."""

    num_blocks: int
    attention: tuple[Linear, ...]
    mlp: tuple[Linear, ...]
    """The dense MLP, or an MoE block's shared expert and its gate."""
    attention_norm_params: int
    """q_norm / k_norm weights (Qwen3, Gemma 3): one head_dim vector each."""
    norm_params: int
    """The block's RMSNorm weights (2 for Llama-style blocks, 4 for Gemma 2/3)."""
    expert_params: int = 0
    """3-D expert tensors plus the router weight (MoE). Plain nn.Parameters in transformers 5, so
    bitsandbytes leaves them unquantized and LoRA's all-linear does not reach them."""
    active_expert_params: int = 0
    """Expert parameters one token passes through: top-k experts plus the router."""
    mlp_width: int = 0
    """Elements per token of the widest MLP activation (intermediate size, summed over the top-k
    experts and the shared expert for MoE): sizes the saved activations."""

    @property
    def linears(self) -> tuple[Linear, ...]:
        return self.attention + self.mlp

    @property
    def attention_params(self) -> int:
        return sum(lin.params for lin in self.attention) + self.attention_norm_params

    @property
    def mlp_params(self) -> int:
        return sum(lin.params for lin in self.mlp) + self.expert_params

    @property
    def mlp_active_params(self) -> int:
        return sum(lin.params for lin in self.mlp) + self.active_expert_params

    @property
    def params(self) -> int:
        return self.attention_params + self.mlp_params + self.norm_params

    @property
    def active_params(self) -> int:
        return self.attention_params + self.mlp_active_params + self.norm_params

    @property
    def linear_weight_params(self) -> int:
        return sum(lin.weight_params for lin in self.linears)


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    blocks: tuple[BlockShape, ...]
    logit_softcapping: bool = False
    """Gemma 2 caps logits with tanh: one more vocab-sized tensor per token in the loss."""
    notes: tuple[str, ...] = ()
    """Caveats the planner repeats as warnings (e.g. a vision tower that is not counted)."""

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """0 when tied: the head reuses the embedding matrix (counted once, as torch does)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def final_norm_params(self) -> int:
        return self.hidden_size

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder blocks: embeddings, final norm, LM head."""
        return self.embedding_params + self.final_norm_params + self.lm_head_params

    @property
    def block_params(self) -> int:
        return sum(b.num_blocks * b.params for b in self.blocks)

    @property
    def total_params(self) -> int:
        return self.root_params + self.block_params

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (== total_params for dense models)."""
        return self.root_params + sum(b.num_blocks * b.active_params for b in self.blocks)

    @property
    def max_block_params(self) -> int:
        """The largest block: what FSDP gathers at once."""
        return max(b.params for b in self.blocks)

    @property
    def linear_weight_params(self) -> int:
        """Weights of the blocks' nn.Linear layers: what 4-bit/8-bit quantization replaces."""
        return sum(b.num_blocks * b.linear_weight_params for b in self.blocks)

    @property
    def is_moe(self) -> bool:
        return self.model_type in MOE


# --------------------------------------------------------------------------------------------
# shape from a config dict


def model_shape(config: dict) -> ModelShape:
    """Parameter counts per component and activation dims, from a config.json dict."""
    model_type = config.get("model_type")
    notes: tuple[str, ...] = ()
    if model_type == "gemma3" and "text_config" in config:
        # Gemma 3 4B+ checkpoints are multimodal; fine-tuning here trains the text decoder.
        notes = ("gemma3: the vision tower (SigLIP, ~0.4B params) is not counted; only the text decoder is",)
        config = {"model_type": "gemma3_text", **config["text_config"]}
        model_type = "gemma3_text"
    if model_type not in SUPPORTED:
        raise UserError(
            f"config.json: model_type {model_type!r} is not supported by the planner; "
            f"supported: {', '.join(sorted(SUPPORTED))}"
        )
    key = _reader(config, model_type)
    hidden = key("hidden_size")
    heads = key("num_attention_heads")
    kv_heads = key("num_key_value_heads") or heads
    head_dim = key("head_dim") or hidden // heads
    num_layers = key("num_hidden_layers")
    blocks = _blocks(key, model_type, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, num_layers=num_layers)
    tied = key("tie_word_embeddings") if "tie_word_embeddings" in config else model_type in _TIED_BY_DEFAULT
    return ModelShape(
        model_type=model_type,
        vocab_size=key("vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=key("max_position_embeddings"),
        tie_word_embeddings=bool(tied),
        blocks=blocks,
        logit_softcapping=bool(key("final_logit_softcapping")),
        notes=notes,
    )


def _reader(config: dict, model_type: str):
    def key(name: str):
        if name in config and config[name] is not None:
            return config[name]
        if name in _DEFAULTS:
            return _DEFAULTS[name]
        raise UserError(f"config.json ({model_type}): required key {name!r} is missing")

    return key


def _blocks(key, model_type: str, *, hidden: int, heads: int, kv_heads: int, head_dim: int, num_layers: int):
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    attention = _attention(key, model_type, hidden=hidden, q_out=q_out, kv_out=kv_out)
    # Qwen3 and Gemma 3 normalise q and k per head: two head_dim-sized RMSNorm weights.
    qk_norm = 2 * head_dim if model_type in ("qwen3", "gemma3_text", "qwen3_moe") else 0
    # Gemma 2/3 add pre/post-feedforward norms to the usual input and post-attention ones.
    norms = (4 if model_type in ("gemma2", "gemma3_text") else 2) * hidden

    def dense(size: int, count: int) -> BlockShape:
        return BlockShape(count, attention, _dense_mlp(key, model_type, hidden, size), qk_norm, norms, mlp_width=size)

    if model_type in LLAMA_LIKE:
        return (dense(key("intermediate_size"), num_layers),)
    if model_type == "mixtral":
        experts, top_k, size = key("num_local_experts"), key("num_experts_per_tok"), key("intermediate_size")
        per_expert = 3 * hidden * size  # gate_up_proj (2*size x hidden) + down_proj (hidden x size)
        router = experts * hidden
        moe = BlockShape(num_layers, attention, (), qk_norm, norms, experts * per_expert + router,
                         top_k * per_expert + router, mlp_width=top_k * size)
        return (moe,)
    # Qwen2-MoE / Qwen3-MoE: a layer is sparse unless listed in mlp_only_layers or skipped by
    # decoder_sparse_step (modeling_qwen2_moe.py: `(layer_idx + 1) % decoder_sparse_step == 0`).
    experts, top_k, size = key("num_experts"), key("num_experts_per_tok"), key("moe_intermediate_size")
    step, dense_only = key("decoder_sparse_step"), set(key("mlp_only_layers"))
    num_sparse = sum(1 for i in range(num_layers) if i not in dense_only and experts > 0 and (i + 1) % step == 0)
    per_expert, router = 3 * hidden * size, experts * hidden
    shared: tuple[Linear, ...] = ()
    shared_size = key("shared_expert_intermediate_size") if model_type == "qwen2_moe" else 0
    if shared_size:
        shared = _dense_mlp(key, model_type, hidden, shared_size) + (Linear("shared_expert_gate", hidden, 1),)
    sparse = BlockShape(num_sparse, attention, shared, qk_norm, norms, experts * per_expert + router,
                        top_k * per_expert + router, mlp_width=top_k * size + shared_size)
    out = (sparse,) if num_sparse else ()
    if num_layers - num_sparse:
        out += (dense(key("intermediate_size"), num_layers - num_sparse),)
    return out


def _attention(key, model_type: str, *, hidden: int, q_out: int, kv_out: int) -> tuple[Linear, ...]:
    if model_type == "phi3":
        # Phi-3 fuses q, k and v into one projection (modeling_phi3.py: op_size).
        return (Linear("qkv_proj", hidden, q_out + 2 * kv_out), Linear("o_proj", q_out, hidden))
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False  # hard-wired in modeling_qwen2.py
    elif model_type == "qwen2_moe":
        qkv_bias, o_bias = key("qkv_bias"), False
    else:
        qkv_bias = o_bias = bool(key("attention_bias"))
    return (
        Linear("q_proj", hidden, q_out, qkv_bias),
        Linear("k_proj", hidden, kv_out, qkv_bias),
        Linear("v_proj", hidden, kv_out, qkv_bias),
        Linear("o_proj", q_out, hidden, o_bias),
    )


def _dense_mlp(key, model_type: str, hidden: int, size: int) -> tuple[Linear, ...]:
    if model_type == "phi3":
        return (Linear("gate_up_proj", hidden, 2 * size), Linear("down_proj", size, hidden))
    bias = bool(key("mlp_bias")) if model_type == "llama" else False
    return (Linear("gate_proj", hidden, size, bias), Linear("up_proj", hidden, size, bias), Linear("down_proj", size, hidden, bias))
