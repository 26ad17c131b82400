"""The checkpoint tensors llama.cpp holds under another name, in another layout, or as several.

Each is a `Reshaped` rule read from convert_hf_to_gguf.py: which checkpoint tensor it applies to
(by the end of its name), the names gguf-py's TensorNameMap places its parts under, and the two
directions, `split` (the checkpoint tensor, experts stacked on axis 0 -> its GGUF parts, in
Hugging Face's row order; gguf_arch.Target then applies the q/k permutation and the norm offset
by GGUF name) and `join` (its exact inverse, which the read-back check loads into the reference
model, so a rule that loses or moves a value fails the check). The rules are:

- renames gguf-py's map spells otherwise (the router's selection bias, gpt-oss's sinks and expert
  biases);
- gpt-oss's experts (GptOssModel): `gate_up_proj` (experts, hidden, 2 x ff) holds gate and up
  interleaved column by column, split into llama.cpp's `ffn_gate_exps` / `ffn_up_exps` as
  (experts, ff, hidden); `down_proj` (experts, ff, hidden) transposed;
- MLA's kv_b_proj (DeepseekV2Model) split into attn_k_b (each head's nope rows transposed) and
  attn_v_b;
- Qwen 3.5's gated delta net (Qwen3NextModel + _LinearAttentionVReorderBase): A_log written as
  A = -exp(A_log), and the value heads reordered from grouped by key head to tiled
  (`v_heads_tiled`), which llama.cpp's broadcast expects;
- Qwen3-Next's A = -exp(A_log) and its dt_bias renamed;
- Gemma 4's layer scale, stacked experts and router scales renamed;
- the Mamba 2 mixers of the hybrids (Granite 4 hybrid, Falcon-H1, Nemotron-H), and Nemotron-H's
  experts under gguf-py's merged name;
- Llama 4's experts: gate_up_proj cut into its gate and up column halves, each transposed, and
  down_proj transposed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Reshaped:
    """One checkpoint tensor llama.cpp holds otherwise (module docstring)."""

    suffix: str
    """The end of the checkpoint name it applies to, after a dot (`mlp.experts.gate_up_proj`)."""
    parts: tuple[str, ...]
    """What replaces `suffix` in the names gguf-py's map looks up, one per GGUF tensor."""
    shapes: Callable[[Shape, object], tuple[Shape, ...]]
    """The parts' shapes from the checkpoint tensor's (and the config), before any unit dimension
    is squeezed."""
    split: Callable[[np.ndarray, object], tuple[np.ndarray, ...]]
    join: Callable[[Sequence[np.ndarray], object], np.ndarray]
    squeeze: bool = True
    """Whether the parts lose their unit dimensions as the converter's squeeze does (not Mamba 2's
    A and D, which llama.cpp holds as (heads, 1) columns)."""
    lora: str = ""
    """How a LoRA pair of the weight follows the rule into llama.cpp's LoRA GGUF (gguf_adapter):
    "rows" where the rule moves or cuts whole rows (B's rows go with them, A is shared), "columns"
    where it moves whole columns (A's), empty where it mixes both (no LoRA pair can hold it)."""
    dense_parts: tuple[str, ...] = ()
    """`parts` in a model without routed experts, where they differ (Granite 4 hybrid's shared MLP
    is then its MLP: GraniteMoeModel.modify_tensors); as many as `parts`."""
    prefix_as: tuple[str, str] = ()
    """(old, new): the start of the name before `suffix` as gguf-py's map spells it (Nemotron-H's
    stacked experts are `model.layers.N.mlp.experts.*` there, its checkpoint's `backbone.layers.N.*`)."""

    def applies(self, key: str) -> bool:
        return key == self.suffix or key.endswith("." + self.suffix)

    def names(self, key: str, config) -> list[str]:
        """The names gguf-py's map looks up for the parts of checkpoint tensor `key`."""
        prefix = key[: len(key) - len(self.suffix)]
        if self.prefix_as and prefix.startswith(self.prefix_as[0]):
            prefix = self.prefix_as[1] + prefix[len(self.prefix_as[0]):]
        dense = self.dense_parts and not getattr(config, "num_local_experts", None)
        return [prefix + part for part in (self.dense_parts if dense else self.parts)]


def renamed(suffix: str, to: str) -> Reshaped:
    """A tensor gguf-py's map knows under another name, values untouched."""
    return Reshaped(suffix, (to,), shapes=lambda shape, config: (shape,), split=lambda array, config: (array,),
                    join=lambda parts, config: parts[0], lora="rows")


def transposed(suffix: str, to: str) -> Reshaped:
    """A stacked expert matrix Hugging Face keeps as (experts, in, out), llama.cpp as (experts, out, in)."""
    return Reshaped(suffix, (to,), shapes=lambda shape, config: ((*shape[:-2], shape[-1], shape[-2]),),
                    split=lambda array, config: (array.swapaxes(-1, -2),),
                    join=lambda parts, config: parts[0].swapaxes(-1, -2))


def _deinterleave(array: np.ndarray, *, matrix: bool) -> tuple[np.ndarray, np.ndarray]:
    gate, up = array[..., ::2], array[..., 1::2]
    return (gate.swapaxes(-1, -2), up.swapaxes(-1, -2)) if matrix else (gate, up)


def _interleave(parts: Sequence[np.ndarray], *, matrix: bool) -> np.ndarray:
    gate, up = (part.swapaxes(-1, -2) for part in parts) if matrix else parts
    out = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), dtype=gate.dtype)
    out[..., ::2], out[..., 1::2] = gate, up
    return out


def _halves(shape: Shape, *, matrix: bool) -> tuple[Shape, Shape]:
    half = (*shape[:-1], shape[-1] // 2)
    return (half[:-2] + (half[-1], half[-2]),) * 2 if matrix else (half, half)


GPT_OSS = (
    Reshaped("mlp.experts.gate_up_proj", ("mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight"),
             shapes=lambda shape, config: _halves(shape, matrix=True),
             split=lambda array, config: _deinterleave(array, matrix=True),
             join=lambda parts, config: _interleave(parts, matrix=True)),
    Reshaped("mlp.experts.gate_up_proj_bias", ("mlp.experts.gate_proj.bias", "mlp.experts.up_proj.bias"),
             shapes=lambda shape, config: _halves(shape, matrix=False),
             split=lambda array, config: _deinterleave(array, matrix=False),
             join=lambda parts, config: _interleave(parts, matrix=False)),
    transposed("mlp.experts.down_proj", "mlp.experts.down_proj.weight"),
    renamed("mlp.experts.down_proj_bias", "mlp.experts.down_proj.bias"),
    renamed("self_attn.sinks", "self_attn.sinks.weight"),
)
"""GptOssModel.modify_tensors on a checkpoint not in MXFP4 (a merged fine-tune): gate_up's even
columns are the gate, its odd ones up (transformers' GptOssExperts._apply_gate), each written as
llama.cpp's (experts, ff, hidden); the sinks get the `.weight` gguf-py's name ends in."""

GEMMA4 = (
    renamed("layer_scalar", "layer_scalar.weight"),
    renamed("experts.gate_up_proj", "experts.gate_up_proj.weight"),
    renamed("experts.down_proj", "experts.down_proj.weight"),
    renamed("router.scale", "router.proj.scale"),
    renamed("router.per_expert_scale", "experts.down_proj.scale"),
)
"""Gemma4Model's names: the layer's output scale and the stacked experts get the `.weight` gguf-py's
names end in (filter_tensors); the router's input scale becomes `ffn_gate_inp.scale` and its
per-expert weight scale `ffn_down_exps.scale`, which models/gemma4.cpp multiplies each expert's
output by (modify_tensors). The experts keep transformers' layout: gate_up_proj (experts, 2 x ff,
hidden) is llama.cpp's ffn_gate_up_exps, gate rows first."""

def _halves_of_rows(array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return tuple(np.split(array, 2, axis=-2))


def _row_halves(shape: Shape, config) -> tuple[Shape, Shape]:
    half = (*shape[:-2], shape[-2] // 2, shape[-1])
    return half, half


GRANITE_HYBRID = (
    Reshaped("block_sparse_moe.input_linear.weight", ("mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight"),
             shapes=_row_halves, split=lambda array, config: _halves_of_rows(array),
             join=lambda parts, config: np.concatenate(parts, axis=-2)),
    Reshaped("shared_mlp.input_linear.weight", ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
             dense_parts=("mlp.gate_proj.weight", "mlp.up_proj.weight"), shapes=_row_halves, lora="rows",
             split=lambda array, config: _halves_of_rows(array), join=lambda parts, config: np.concatenate(parts, axis=-2)),
    Reshaped("shared_mlp.output_linear.weight", ("shared_mlp.output_linear.weight",), dense_parts=("mlp.down_proj.weight",),
             lora="rows",
             shapes=lambda shape, config: (shape,), split=lambda array, config: (array,), join=lambda parts, config: parts[0]),
)
"""GraniteMoeModel.modify_tensors: the experts' fused input_linear (experts, 2 x ff, hidden) cut into
gate (first half of the rows) and up; the shared MLP's likewise, as the shared expert's, or as
the MLP itself in a model without routed experts (Granite 4.0-H Micro)."""


def _scaled(suffix: str, factor: Callable[[object], float]) -> Reshaped:
    """A weight written times a multiplier the model applies to its input or output, which
    llama.cpp's graph does not (Falcon-H1's muP multipliers): the same product, one multiply less."""
    return Reshaped(suffix, (suffix,), shapes=lambda shape, config: (shape,), lora="rows",
                    split=lambda array, config: (array * np.float32(factor(config)),),
                    join=lambda parts, config: parts[0] / np.float32(factor(config)))


def _in_proj_rows(config) -> np.ndarray:
    """Falcon-H1's mamba in_proj row multipliers: ssm_in_multiplier times the z, x, B, C and dt
    blocks' ssm_multipliers (transformers' compute_mup_vector)."""
    inner, state = config.mamba_d_ssm, config.mamba_n_groups * config.mamba_d_state
    sizes = (inner, inner, state, state, config.mamba_n_heads)
    rows = np.concatenate([np.full(size, m, dtype=np.float64) for size, m in zip(sizes, config.ssm_multipliers,
                                                                                 strict=True)])
    return (rows * config.ssm_in_multiplier).astype(np.float32)[:, None]


FALCON_H1 = (
    _scaled("feed_forward.gate_proj.weight", lambda config: config.mlp_multipliers[0]),
    _scaled("feed_forward.down_proj.weight", lambda config: config.mlp_multipliers[1]),
    _scaled("self_attn.q_proj.weight", lambda config: config.attention_in_multiplier),
    _scaled("self_attn.k_proj.weight", lambda config: config.attention_in_multiplier * config.key_multiplier),
    _scaled("self_attn.v_proj.weight", lambda config: config.attention_in_multiplier),
    _scaled("self_attn.o_proj.weight", lambda config: config.attention_out_multiplier),
    _scaled("mamba.out_proj.weight", lambda config: config.ssm_out_multiplier),
    _scaled("embed_tokens.weight", lambda config: config.embedding_multiplier),
    _scaled("lm_head.weight", lambda config: config.lm_head_multiplier),
    Reshaped("mamba.in_proj.weight", ("mamba.in_proj.weight",), shapes=lambda shape, config: (shape,), lora="rows",
             split=lambda array, config: (array * _in_proj_rows(config),),
             join=lambda parts, config: parts[0] / _in_proj_rows(config)),
)
"""FalconH1Model.modify_tensors: every muP multiplier of Falcon-H1 folded into the weight it
multiplies the input or output of (llama.cpp's falcon-h1 graph applies none); a multiplier that
is not a power of two makes the read-back divide back within a float32 ulp, not bit for bit."""


def _ssm_groups(config) -> int:
    return getattr(config, "mamba_n_groups", None) or getattr(config, "n_groups", None) or 1


def mamba2(prefix: str) -> tuple[Reshaped, ...]:
    """Mamba2Model.modify_tensors on a hybrid's Mamba 2 mixer (`<prefix>.*`: Granite 4 hybrid's
    `mamba`): dt_bias as dt_proj.bias; A = -exp(A_log) and D as (heads, 1) columns, never squeezed;
    the gated norm's weight as (groups, inner / groups), which llama.cpp normalises group by group."""
    column = {"shapes": lambda shape, config: ((*shape, 1),), "squeeze": False}
    return (
        renamed(f"{prefix}.dt_bias", f"{prefix}.dt_proj.bias"),
        Reshaped(f"{prefix}.A_log", (f"{prefix}.A_log",), split=lambda array, config: (_a_from_log(array)[:, None],),
                 join=lambda parts, config: _log_from_a(parts[0][:, 0]), **column),
        Reshaped(f"{prefix}.D", (f"{prefix}.D",), split=lambda array, config: (array[:, None],),
                 join=lambda parts, config: parts[0][:, 0], **column),
        Reshaped(f"{prefix}.norm.weight", (f"{prefix}.norm.weight",), squeeze=False,
                 shapes=lambda shape, config: ((_ssm_groups(config), shape[0] // _ssm_groups(config)),),
                 split=lambda array, config: (array.reshape(_ssm_groups(config), -1),),
                 join=lambda parts, config: parts[0].reshape(-1)),
    )


def _column_halves(array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    gate, up = np.split(array, 2, axis=-1)
    return gate.swapaxes(-1, -2), up.swapaxes(-1, -2)


LLAMA4 = (
    Reshaped("feed_forward.experts.gate_up_proj", ("feed_forward.experts.gate_proj.weight",
                                                   "feed_forward.experts.up_proj.weight"),
             shapes=lambda shape, config: _halves(shape, matrix=True), split=lambda array, config: _column_halves(array),
             join=lambda parts, config: np.concatenate([part.swapaxes(-1, -2) for part in parts], axis=-1)),
    transposed("feed_forward.experts.down_proj", "feed_forward.experts.down_proj.weight"),
)
"""Llama4Model.modify_tensors: the experts' fused gate_up_proj (experts, hidden, 2 x ff) holds gate
then up column halves (Llama4TextExperts: gate_up.chunk(2, -1)), written as llama.cpp's
ffn_gate_exps / ffn_up_exps (experts, ff, hidden), gguf-py 0.19 having no fused gate_up for llama4;
down_proj (experts, ff, hidden) transposed."""


def _stacked_experts(projection: str) -> Reshaped:
    return Reshaped(f"mixer.experts.{projection}.weight", (f"mlp.experts.{projection}.weight",),
                    prefix_as=("backbone.", "model."), shapes=lambda shape, config: (shape,),
                    split=lambda array, config: (array,), join=lambda parts, config: parts[0])


NEMOTRON_H = (
    _stacked_experts("up_proj"),
    _stacked_experts("down_proj"),
    renamed("mixer.gate.e_score_correction_bias", "mixer.gate.e_score_correction.bias"),
)
"""NemotronHModel.modify_tensors (MoE): each layer's experts stacked under gguf-py's merged
`model.layers.N.mlp.experts.*` name, the router's selection bias renamed; the Mamba 2 mixer is
mamba2("mixer")'s."""

SELECTION_BIAS = renamed("mlp.gate.e_score_correction_bias", "mlp.gate.e_score_correction.bias")
"""The router's selection bias of DeepSeek-style MoE (GLM-4.5, DeepSeek-V3), which llama.cpp's
converter renames before mapping it (`blk.N.exp_probs_b.bias`)."""


# ---------------------------------------------------------------------------------------- MLA


def split_kv_b(kv_b: np.ndarray, config) -> tuple[np.ndarray, np.ndarray]:
    """MLA's kv_b_proj (heads x (nope + v) rows, kv_lora_rank columns) as DeepseekV2Model splits it
    for llama.cpp's absorbed attention: k_b (heads, kv_lora_rank, nope), each head's nope rows
    transposed, and v_b (heads, v, kv_lora_rank)."""
    nope = config.qk_nope_head_dim
    kv = kv_b.reshape(config.num_attention_heads, nope + config.v_head_dim, kv_b.shape[-1])
    return kv[:, :nope].swapaxes(1, 2), kv[:, nope:]


def merge_kv_b(parts: Sequence[np.ndarray], config) -> np.ndarray:
    """The inverse of split_kv_b."""
    k_b, v_b = parts
    kv = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)
    return kv.reshape(-1, kv.shape[-1])


def _kv_b_shapes(shape: Shape, config) -> tuple[Shape, Shape]:
    heads, rank = config.num_attention_heads, config.kv_lora_rank
    return (heads, rank, config.qk_nope_head_dim), (heads, config.v_head_dim, rank)


MLA_KV_B = Reshaped("self_attn.kv_b_proj.weight", ("self_attn.k_b_proj.weight", "self_attn.v_b_proj.weight"),
                    shapes=_kv_b_shapes, split=split_kv_b, join=merge_kv_b)


# ---------------------------------------------------------------------- gated delta net (Qwen)


def v_heads_tiled(array: np.ndarray, config, *, axis: int, head_dim: int, inverse: bool = False) -> np.ndarray:
    """The value heads along `axis` from Hugging Face's order, grouped by key head ([k0: v0 v1 ..,
    k1: v0 v1 ..]), to the tiled order llama.cpp's broadcast of the key heads reads ([k0 v0, k1
    v0, .., k0 v1, ..]) (_LinearAttentionVReorderBase._reorder_v_heads); `inverse` goes back."""
    keys, values = config.linear_num_key_heads, config.linear_num_value_heads
    groups = (values // keys, keys) if inverse else (keys, values // keys)
    axis %= array.ndim
    shape = array.shape
    array = array.reshape(*shape[:axis], *groups, head_dim, *shape[axis + 1:])
    return array.swapaxes(axis, axis + 1).reshape(shape)


def _qkv_rows(array: np.ndarray, config, *, inverse: bool) -> np.ndarray:
    """in_proj_qkv's (and the conv's) rows: q and k as they are, v's heads reordered."""
    qk = 2 * config.linear_num_key_heads * config.linear_key_head_dim
    v = v_heads_tiled(array[qk:], config, axis=0, head_dim=config.linear_value_head_dim, inverse=inverse)
    return np.concatenate([array[:qk], v])


def _per_v_head(suffix: str, to: str, *, axis: int, head_dim: Callable[[object], int],
                values: tuple[Callable, Callable] | None = None) -> Reshaped:
    """A tensor whose `axis` runs over the value heads (`head_dim` each), reordered; `values` maps
    the numbers written and back."""
    forward, back = values or (lambda a: a, lambda a: a)
    return Reshaped(suffix, (to,), shapes=lambda shape, config: (shape,), lora="" if values else ("rows", "columns")[axis],
                    split=lambda array, config: (forward(v_heads_tiled(array, config, axis=axis,
                                                                       head_dim=head_dim(config))),),
                    join=lambda parts, config: v_heads_tiled(back(parts[0]), config, axis=axis,
                                                             head_dim=head_dim(config), inverse=True))


def _a_from_log(a_log: np.ndarray) -> np.ndarray:
    return -np.exp(a_log.astype(np.float64)).astype(np.float32)


def _log_from_a(a: np.ndarray) -> np.ndarray:
    return np.log(-a.astype(np.float64)).astype(np.float32)


def _v_dim(config) -> int:
    return config.linear_value_head_dim


def _one(config) -> int:
    return 1


QWEN35_DELTA_NET = (
    Reshaped("linear_attn.in_proj_qkv.weight", ("linear_attn.in_proj_qkv.weight",), lora="rows",
             shapes=lambda shape, config: (shape,), split=lambda array, config: (_qkv_rows(array, config, inverse=False),),
             join=lambda parts, config: _qkv_rows(parts[0], config, inverse=True)),
    Reshaped("linear_attn.conv1d.weight", ("linear_attn.conv1d.weight",),
             shapes=lambda shape, config: (shape,), split=lambda array, config: (_qkv_rows(array, config, inverse=False),),
             join=lambda parts, config: _qkv_rows(parts[0], config, inverse=True)),
    _per_v_head("linear_attn.in_proj_z.weight", "linear_attn.in_proj_z.weight", axis=0, head_dim=_v_dim),
    _per_v_head("linear_attn.in_proj_a.weight", "linear_attn.in_proj_a.weight", axis=0, head_dim=_one),
    _per_v_head("linear_attn.in_proj_b.weight", "linear_attn.in_proj_b.weight", axis=0, head_dim=_one),
    _per_v_head("linear_attn.out_proj.weight", "linear_attn.out_proj.weight", axis=1, head_dim=_v_dim),
    _per_v_head("linear_attn.dt_bias", "linear_attn.dt_proj.bias", axis=0, head_dim=_one),
    _per_v_head("linear_attn.A_log", "linear_attn.A_log", axis=0, head_dim=_one, values=(_a_from_log, _log_from_a)),
)
"""Qwen 3.5 (dense and MoE) as Qwen3_5TextModel converts it: Qwen3NextModel's A = -exp(A_log) and
dt_bias renamed to dt_proj.bias, then every value-head axis reordered. -exp and log round-trip in
float64 to within one float32 ulp, not bit for bit: the read-back is exact for every other tensor."""

QWEN3NEXT_DELTA_NET = (
    renamed("linear_attn.dt_bias", "linear_attn.dt_proj.bias"),
    Reshaped("linear_attn.A_log", ("linear_attn.A_log",), shapes=lambda shape, config: (shape,),
             split=lambda array, config: (_a_from_log(array),), join=lambda parts, config: _log_from_a(parts[0])),
)
"""Qwen3-Next as Qwen3NextModel converts it, less the split of in_proj_qkvz: that is written whole as
`ssm_in`, which gguf-py 0.19 maps it to and every llama.cpp build with qwen3next reads (models/
qwen3next.cpp's legacy path cuts it per key head as transformers does); newer converters write it
as attn_qkv + attn_gate, an optimisation. Its value heads stay grouped by key head: qwen3next.cpp
repeats q and k interleaved to match."""
