"""Tiny random models of many transformers families, built from transformers' own default configs.

`transformers.CONFIG_MAPPING[model_type]()` gives each family's real default config (its layer
pattern, MoE and linear-attention keys); `tiny_config` shrinks every size key it has to a few
dozen units, so a test can build, save and train the family on a CPU in seconds. Nothing here
names a family's modules: only config keys transformers itself declares are changed.
"""

from __future__ import annotations

from pathlib import Path

# Size keys and their tiny values, applied when a config has the key. One table for every family.
_TINY_SIZES = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "intermediate_size_mlp": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "sliding_window": 8,
    "attention_chunk_size": 8,
    # MoE
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    # multi-head latent attention (DeepSeek)
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "qk_head_dim": 16,
    # linear attention (Qwen3-Next / Qwen 3.5 gated delta net)
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    # Mamba mixers (Falcon-H1, Granite 4 hybrid, Nemotron-H)
    "mamba_n_heads": 4,
    "mamba_num_heads": 4,
    "mamba_d_head": 32,
    "mamba_head_dim": 32,
    "mamba_d_state": 16,
    "ssm_state_size": 16,
    "mamba_d_ssm": 128,
    "mamba_n_groups": 1,
    "n_groups": 1,
    "mamba_chunk_size": 16,
    "chunk_size": 16,
    # per-layer embeddings (Gemma 3n / 4 "E" models)
    "vocab_size_per_layer_input": 320,
    "hidden_size_per_layer_input": 8,
    "num_kv_shared_layers": 0,
    "num_nextn_predict_layers": 0,
}

_INIT_ONLY = {"global_head_dim": 16}
"""Constructor arguments a config consumes without storing them (Gemma 4's full-attention head_dim)."""

_DERIVED = ("per_layer_config",)
"""Fields a config derives from its layer pattern: rebuilt by the constructor, never copied."""

RUNNABLE = {
    # transformers' default Granite 4 hybrid is Mamba-only, which its own forward cannot run (the
    # cache needs one attention layer); the released Granite 4 "H" models mix both.
    "granitemoehybrid": {"layer_types": ["linear_attention"] * 3 + ["attention"]},
}
"""The few families whose default config is not a model anyone ships: what the released ones have."""

AS_RELEASED = {
    "mistral": {"sliding_window": None},
    "gemma2": {"query_pre_attn_scalar": 16},
    "gemma3_text": {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
                    "query_pre_attn_scalar": 16},
    "qwen3_moe": {"norm_topk_prob": True},
    "glm4_moe": {"attention_bias": True},
    "nemotron_h": {"layers_block_type": ["linear_attention", "moe", "full_attention", "moe"]},
    "llama4_text": {"attention_chunk_size": 8192},
}
"""What every released checkpoint of these families has and llama.cpp assumes with no GGUF key
(gguf_layouts.LAYOUTS' `fixed`), where transformers' default config (shrunk below) differs: Gemma 2/3's
query scale 1/sqrt(head_dim) (query_pre_attn_scalar = head_dim), Gemma 3's 5:1 sliding pattern, Qwen3-MoE's normalised top-k weights
(Qwen3-30B-A3B sets norm_topk_prob); Mistral's unwindowed attention (7B v0.2 on, Nemo, Small: the
tiny default's 8-token window is refused as shorter than the check's prompts); GLM-4.5(-Air)'s q/k/v biases (attention_bias true, which
llama.cpp loads where the file has them); Nemotron-H's blocks of one kind of feed-forward (Nemotron 3
Nano's Mamba, MoE and attention blocks; Nemotron-H 8B and Nano 9B v2 have MLP blocks instead), where
transformers' default has both; Llama 4's 8192-token attention chunks (Scout, Maverick: llama.cpp fixes
8192, where the tiny default's 8 would chunk the check's prompts). The GGUF tests build these families so."""

ALL_EXPERTS = {"gpt_oss": {"num_experts_per_tok": 4}}
"""A tiny gpt-oss whose every token takes all 4 experts, for the q8_0 logit bound: with 2 of 4 a
random router leaves near-ties that q8_0's rounding of the layers before it flips at a few of the
check's ~200 positions (measured: 0.17-0.29 against the 0.1 bound, on seeds 0-2), and each flip
moves that position's logits by the whole expert's output, which in a random model is as large as
the residual stream. f32 is bit-exact either way and is tested with the default 2 of 4."""

def _qk_norms_scaled(state: dict) -> None:
    """Gemma 4 attends with scaling 1.0 (Gemma4TextAttention.scaling): a trained checkpoint's q/k
    norm weights carry the 1/sqrt(head_dim) that random init's ones lack, without which the
    attention logits of a 512-wide full-attention head are so sharp that q8_0's rounding of q or k
    moves the model's logits by 0.26 against the 0.1 bound (scaled: 0.04-0.05, seeds 0-2)."""
    for name in [n for n in state if n.endswith(("q_norm.weight", "k_norm.weight"))]:
        state[name] = state[name] * state[name].shape[0] ** -0.25


AS_TRAINED = {"gemma4_text": _qk_norms_scaled}
"""Weights a trained checkpoint of the family has where random init has others that a lossy GGUF
type's bound cannot stand (save_tiny(as_trained=True)); the layout under test is the same."""

LAYERS = 4
"""Decoder blocks of every tiny model: enough for a repeating pattern (3 linear + 1 full attention)."""


def tiny_config(model_type: str, **overrides):
    """The default config of `model_type` rebuilt with tiny sizes through its own constructor (so its
    derived fields, per-layer overrides and validation follow); a multimodal config shrinks its
    `text_config`, which is what a text-only fine-tune trains."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    overrides = {**RUNNABLE.get(model_type, {}), **overrides}
    text = getattr(default, "text_config", None)
    if text is None:
        return config_class(**{**_tiny_kwargs(default), **overrides})
    text_kwargs = {k: v for k, v in text.to_dict().items() if k not in _DERIVED}
    return config_class(text_config={**text_kwargs, **_tiny_kwargs(text), **overrides})


def _tiny_kwargs(config) -> dict:
    present = config.to_dict()
    kwargs = {key: value for key, value in _TINY_SIZES.items() if present.get(key) is not None}
    kwargs.update({key: value for key, value in _INIT_ONLY.items() if key in _init_keys(config)})
    if "qk_rope_head_dim" in kwargs:  # multi-head latent attention: rotary width is the head_dim,
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
        # and kv_b_proj makes one key per query head (DeepSeek-V3 ships 128 and 128; 2 of 4 repeated
        # the keys twice in transformers' attention and broke any padded batch)
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    kwargs["num_hidden_layers"] = LAYERS
    pattern = present.get("layer_types")
    if pattern and not isinstance(getattr(type(config), "layer_types", None), property):
        kwargs["layer_types"] = _tiny_pattern(list(pattern))
    elif present.get("layers_block_type") and "layers_block_type" in _init_keys(config):
        kwargs.pop("num_hidden_layers")  # the pattern is the layer count (Nemotron-H)
    for key in ("no_rope_layers",):
        if present.get(key):
            kwargs[key] = (list(present[key]) * LAYERS)[:LAYERS]
    if present.get("moe_layers") is not None:
        kwargs["moe_layers"] = list(range(LAYERS))
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ids = present.get(key)
        if isinstance(ids, int) and ids >= _TINY_SIZES["vocab_size"] or isinstance(ids, list):
            kwargs[key] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[key]
    return kwargs


def _init_keys(config) -> set[str]:
    import dataclasses
    import inspect

    if dataclasses.is_dataclass(config):
        return {f.name for f in dataclasses.fields(config)} | set(inspect.signature(type(config)).parameters)
    return set(inspect.signature(type(config)).parameters)


def _tiny_pattern(full: list[str]) -> list[str]:
    """The first LAYERS entries of the family's layer pattern, with every kind it has kept at least once."""
    pattern = (full * LAYERS)[:LAYERS]
    for kind in dict.fromkeys(full):
        if kind not in pattern:
            pattern[-1] = kind
    return pattern


FAMILIES = (
    # dense, attention only
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "smollm3",
    "olmo2",
    "olmo3",
    "gemma4_text",
    # mixture of experts
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gpt_oss",
    "glm4_moe",
    "phimoe",
    "llama4_text",
    "deepseek_v3",
    # hybrids: linear attention or Mamba layers beside attention
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_next",
    "granitemoehybrid",
    "falcon_h1",
    "nemotron_h",
)
"""The families every rung is tested on: the 12 the planner knew by hand plus what users bring today."""

CORE = ("llama", "gemma3_text", "qwen3_moe", "gpt_oss", "deepseek_v3", "qwen3_5_text", "nemotron_h")
"""One family of each kind of block the code branches on: a dense GQA decoder (llama), sliding
windows and extra norms (gemma3_text), fused MoE experts (qwen3_moe), experts with biases and
attention sinks (gpt_oss), multi-head latent attention (deepseek_v3), gated delta-net linear
attention (qwen3_5_text) and Mamba-2 layers (nemotron_h). `make test-unit` runs a unit test's family
matrix on these; `make test` runs it on every family (tests/conftest.py marks the rest `matrix`)."""

CORE_CONFIGS = ("llama-3-8b", "gemma-3-1b", "mixtral-8x7b", "qwen3-30b-a3b")
"""The released configs of tests/configs that `make test-unit` derives and plans (a dense model, a
sliding-window one, two MoE); `make test` takes every config there."""

MOE = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gpt_oss",
    "glm4_moe",
    "phimoe",
    "llama4_text",
    "deepseek_v3",
    "qwen3_5_moe_text",
    "qwen3_next",
    "granitemoehybrid",
    "nemotron_h",
)
HYBRID = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "granitemoehybrid", "falcon_h1", "nemotron_h")
DENSE = tuple(f for f in FAMILIES if f not in MOE and f not in HYBRID)


def save_tiny(
    out_dir: Path, model_type: str, *, seed: int = 0, with_tokenizer: bool = True, as_trained: bool = False,
    **overrides
) -> Path:
    """Save a tiny random `model_type` causal LM (and the tests' tokenizer) the way `save_pretrained`
    writes a real checkpoint, so loading it goes through the same `from_pretrained` path users hit;
    `as_trained` applies AS_TRAINED's weights."""
    import torch
    from tiny import make_tokenizer
    from transformers import AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    if with_tokenizer:
        make_tokenizer(out_dir, vocab_size=_TINY_SIZES["vocab_size"])
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(out_dir)
    if as_trained and model_type in AS_TRAINED:
        from safetensors.torch import load_file, save_file

        state = load_file(str(out_dir / "model.safetensors"))
        AS_TRAINED[model_type](state)
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def with_config(out_dir: Path, model_dir: Path, **config) -> Path:
    """A copy of `model_dir` at `out_dir` whose config.json has `config` changed: what the GGUF
    refusals read (they read config.json alone, before any weight)."""
    import json
    import shutil

    shutil.copytree(model_dir, out_dir)
    values = json.loads((out_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps({**values, **config}))
    return out_dir
