"""llama.cpp's YaRN against transformers': a numpy transcription of ggml's rope_yarn and
ggml_rope_yarn_corr_dims (ggml-cpu ops.cpp, ggml.c) gives transformers' angles with the
correction range rounded, which gpt-oss's config turns off; RUNNING.md says by how much."""

from __future__ import annotations

import math

import numpy as np
import pytest

from homelab_ft.export.gguf import arch as gguf_arch
from homelab_ft.export.gguf import rope as gguf_rope


def llama_cpp_yarn(*, n_dims: int, base: float, factor: float, n_ctx_orig: int, beta_fast: float, beta_slow: float,
                   attn_factor: float = 1.0) -> tuple[np.ndarray, float]:
    """(each rotary pair's angle per position, the cos/sin magnitude) as ggml computes them for
    position 1: theta_scale = base^(-2/n_dims); corr_dims floored/ceiled and clamped; the ramp
    1 - clamp((i0/2 - low) / max(0.001, high - low)) mixing the interpolated and extrapolated
    angle; mscale = attn_factor * (1 + 0.1 ln(1 / freq_scale)) (ext_factor 1: llama.cpp's default
    for YaRN)."""
    def corr_dim(n_rot: float) -> float:
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(beta_fast)))
    high = min(n_dims - 1.0, math.ceil(corr_dim(beta_slow)))
    freq_scale = 1.0 / factor
    thetas = []
    for pair in range(n_dims // 2):
        extrap = base ** (-2.0 * pair / n_dims)
        y = (pair - low) / max(0.001, high - low)
        mix = 1.0 - min(1.0, max(0.0, y))
        thetas.append(freq_scale * extrap * (1 - mix) + extrap * mix)
    return np.array(thetas), attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale))


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """gpt-oss's released rope (transformers' default GptOssConfig: head 64, theta 150000, YaRN x32
    over 4096 tokens, beta 32/1, truncate false), the config alone."""
    from transformers import CONFIG_MAPPING

    folder = tmp_path_factory.mktemp("gpt-oss")
    CONFIG_MAPPING["gpt_oss"]().save_pretrained(folder)
    return folder


def test_llama_cpp_turns_transformers_angles_with_the_range_rounded(released):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(released)
    rope = config.rope_parameters
    want, mscale = llama_cpp_yarn(n_dims=config.head_dim, base=rope["rope_theta"], factor=rope["factor"],
                                  n_ctx_orig=rope["original_max_position_embeddings"], beta_fast=rope["beta_fast"],
                                  beta_slow=rope["beta_slow"])
    rounded = np.array(gguf_rope.yarn_frequencies(config, truncate=True))
    trained = np.array(gguf_rope.yarn_frequencies(config, truncate=False))
    np.testing.assert_allclose(rounded, want, rtol=1e-5)
    assert not np.allclose(trained, want, rtol=1e-3)  # what the model was trained with is not what llama.cpp turns
    _, attention_scaling = ROPE_INIT_FUNCTIONS["yarn"](config)
    assert attention_scaling == pytest.approx(mscale)  # the magnitude agrees: only the range's rounding differs


def test_running_md_says_what_the_rounding_does_to_gpt_oss(released, tmp_path):
    import json

    [need] = gguf_arch.runtime_needs(released)
    assert "rotary pairs 9-17 of 32 turn up to 1.76x as fast as in training, 0.90 rad apart by 4096 tokens" in need
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    config = json.loads((released / "config.json").read_text())
    config["rope_parameters"]["truncate"] = True
    (truncated / "config.json").write_text(json.dumps(config))
    assert gguf_arch.runtime_needs(truncated) == []  # rounded in the config too: llama.cpp runs it as trained


def test_gemma4s_proportional_rope_is_llama_cpps_neox_rope_with_rope_freqs():
    """ggml's neox rope over the whole head (n_rot = head_dim, Gemma4Model's rope.dimension_count)
    turns pair (i, i + head_dim/2) by pos * base^(-2i/head_dim) / rope_freqs[i]: with the rope_freqs
    gguf_hparams writes it is transformers' proportional rope: its first partial * head_dim / 2 pairs
    at transformers' frequencies (to float32 precision), the rest still at any of Gemma 4's 131072
    positions."""
    import torch
    from families import tiny_config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from homelab_ft.export.gguf import hparams as gguf_hparams

    config = tiny_config("gemma4_text")
    full = config.per_layer_config[config.layer_types.index("full_attention")]
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["proportional"](config, layer_type="full_attention")
    head_dim, base = full.head_dim, config.rope_parameters["full_attention"]["rope_theta"]
    factors = gguf_hparams.rope_freqs(config)
    ggml = base ** (-2.0 * np.arange(head_dim // 2) / head_dim) / factors.astype(np.float64)  # per position
    turned = int(0.25 * head_dim // 2)
    np.testing.assert_allclose(ggml[:turned], inv_freq[:turned].double().numpy(), rtol=1e-6)
    assert (inv_freq[turned:] == 0).all() and (131072 * ggml[turned:]).max() < 1e-20  # still at any position
    assert scaling == 1.0 and torch.count_nonzero(inv_freq) == turned
