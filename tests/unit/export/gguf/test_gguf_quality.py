"""The quality report of a quantized GGUF: rows cut back into samples, agreement and loss from
the two models' next tokens, the one-line report and its warning, and a whole measurement of tiny
models written as q8_0 / q4_0 and read back through transformers' GGUF loader."""

from __future__ import annotations

import math

import pytest
import torch

from homelab_ft.data.templates import IGNORE_INDEX
from homelab_ft.export.gguf import export as gguf_export
from homelab_ft.export.gguf import quality as gguf_quality
from homelab_ft.export.gguf.quality import MASKED, GgufQuality

M = MASKED


def test_masked_label_is_the_data_stages():
    assert MASKED == IGNORE_INDEX


def test_scored_sequences_cut_packed_rows_and_skip_rows_without_labels():
    plain = {"input_ids": [1, 2, 3], "labels": [M, 2, 3]}
    packed = {"input_ids": [1, 2, 3, 4, 5, 6], "labels": [M, 2, 3, M, M, 6], "position_ids": [0, 1, 2, 0, 1, 2]}
    untrained = {"input_ids": [1, 2], "labels": [M, M]}
    pair = {"chosen_input_ids": [1, 2]}
    got = gguf_quality.scored_sequences([plain, packed, untrained, pair])
    assert got == [([1, 2, 3], [M, 2, 3]), ([1, 2, 3], [M, 2, 3]), ([4, 5, 6], [M, M, 6])]


def quality(**kw) -> GgufQuality:
    values = dict(gguf_type="q4_0", num_rows=48, num_tokens=1204, agreement=0.913, loss_gguf=0.812, loss_merged=0.655,
                  rows_from="eval rows")
    return GgufQuality(**(values | kw))


def test_line_warns_above_the_threshold_and_names_less_lossy_types():
    assert quality().line() == (
        "gguf q4_0 vs merged: greedy next-token agreement 91.3% on 48 eval rows (1,204 tokens), eval loss 0.812 vs "
        "0.655 (+0.157); warning: below the 99.5% agreement threshold, q5_1 or q8_0 keeps more")
    calm = quality(gguf_type="q8_0", agreement=0.998, loss_gguf=0.660)
    assert not calm.warns and "warning" not in calm.line() and calm.line().endswith("(+0.005)")
    assert quality(agreement=gguf_quality.AGREEMENT_WARN).warns is False
    assert gguf_quality.less_lossy("q8_0") == ("bf16", "f16")
    report = quality().as_dict()
    assert report["loss_delta"] == pytest.approx(0.157) and report["agreement_threshold"] == 0.995


def test_compare_counts_agreement_and_means_losses_over_tokens():
    want = [(torch.tensor([5, 6]), torch.tensor([1.0, 2.0])), (torch.tensor([7]), torch.tensor([3.0]))]
    got = [(torch.tensor([5, 0]), torch.tensor([2.0, 2.0])), (torch.tensor([7]), torch.tensor([5.0]))]
    q = gguf_quality.compare(want, got, gguf_type="q5_1", rows_from="eval rows")
    assert (q.num_rows, q.num_tokens) == (2, 3)
    assert q.agreement == pytest.approx(2 / 3) and q.loss_merged == pytest.approx(2.0) and q.loss_gguf == pytest.approx(3.0)


def test_next_tokens_score_the_label_after_each_position():
    class Fixed(torch.nn.Module):
        def forward(self, input_ids):
            logits = torch.full((1, input_ids.shape[1], 4), -1e9)
            logits[0, :, 2] = 0.0  # always predicts token 2, with probability 1
            return type("Out", (), {"logits": logits})()

    tokens, nll = gguf_quality.next_tokens(Fixed(), [0, 1, 2, 3], [M, M, 2, 3])
    assert tokens.tolist() == [2, 2] and nll[0] == pytest.approx(0.0) and nll[1] > 1e8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_gguf_export import make_model

    return make_model(tmp_path_factory.mktemp("tiny"), "llama")


def test_measure_tiny_model_on_held_out_prompts_and_on_rows(tiny, tmp_path):
    from transformers import AutoTokenizer

    assert gguf_quality.measure(tmp_path / "unused.gguf", tiny, gguf_type="f16") is None
    reports = {}
    for gguf_type in ("q8_0", "q4_0"):
        path = tmp_path / gguf_export.gguf_file_name(gguf_type)
        gguf_export.write_gguf(tiny, path, gguf_type=gguf_type, name="tiny")
        reports[gguf_type] = gguf_quality.measure(path, tiny, gguf_type=gguf_type)
    q8, q4 = reports["q8_0"], reports["q4_0"]
    assert q8.rows_from == "held-out prompts" and q8.num_rows == len(gguf_quality.HELD_OUT_CHATS) and q8.num_tokens > 0
    assert 0.0 <= q4.agreement <= q8.agreement <= 1.0
    assert math.isfinite(q4.loss_gguf) and q4.loss_merged == pytest.approx(q8.loss_merged)
    assert abs(q8.loss_delta) < abs(q4.loss_delta)

    ids = AutoTokenizer.from_pretrained(tiny)("hello world, hello there")["input_ids"]
    rows = [{"input_ids": ids, "labels": [M] + ids[1:]}] * 3
    on_rows = gguf_quality.measure(tmp_path / "model-q8_0.gguf", tiny, gguf_type="q8_0", rows=lambda: rows)
    assert (on_rows.rows_from, on_rows.num_rows, on_rows.num_tokens) == ("eval rows", 3, 3 * (len(ids) - 1))


def _reference(family: str, out_dir):
    """Models whose sizes transformers' GGUF reader does not read back (issue 38): Qwen3 with
    head_dim 32 != 64 / 4, the issue's Qwen3-MoE (hidden 64, 4 layers, 4 experts of 32) and a
    Qwen2-MoE (expert sizes), Mixtral (read as a dense Llama), Gemma 2/3 with
    query_pre_attn_scalar 16 (read as 256)."""
    from families import save_tiny
    from test_gguf_export import make_model

    if family == "qwen3_moe":
        return save_tiny(out_dir, "qwen3_moe", norm_topk_prob=True)  # as Qwen3-30B-A3B (gguf_layouts.LAYOUTS)
    if family in ("mixtral", "qwen2_moe"):
        return save_tiny(out_dir, family)
    return make_model(out_dir, family)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "gemma2", "gemma3"])
def test_the_gguf_is_measured_in_the_reference_models_own_config(tmp_path, family):
    """Read back at f32 the GGUF's model computes the merged model's logits exactly (they differed
    by 0.15 for Mixtral, 0.49 for Gemma 3, 0.015 for Gemma 2); the default q8_0 is then measured,
    not crashed on (Qwen3, Qwen2/3-MoE: ignore_mismatched_sizes) or judged as another model
    (Mixtral 72.5%, Gemma 3 35.9% before)."""
    from transformers import AutoModelForCausalLM

    from homelab_ft.export.gguf.check import load_gguf_model

    model_dir = _reference(family, tmp_path / family)
    f32 = tmp_path / "model-f32.gguf"
    gguf_export.write_gguf(model_dir, f32, gguf_type="f32", name="tiny")
    ids = torch.tensor([list(range(3, 40))])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(input_ids=ids).logits
        got = load_gguf_model(f32, model_dir, gguf_type="f32").eval()(input_ids=ids).logits
    assert float((got - want).abs().max()) <= 1e-5
    q8 = tmp_path / "model-q8_0.gguf"
    gguf_export.write_gguf(model_dir, q8, gguf_type="q8_0", name="tiny")
    report = gguf_quality.measure(q8, model_dir, gguf_type="q8_0")
    assert report.agreement > 0.9 and abs(report.loss_delta) < 0.01, report.line()
