"""Every family of tests/families.py that homelab-ft writes as GGUF, run in llama.cpp itself (issue
38): llama.cpp b11739's libllama (tools/llama_text.py) on the export check's chat prompts against
transformers on the model the file was written from (tests/llama_text.py). Skipped, with the
reason, where no Python with llama.cpp is configured (HOMELAB_FT_LLAMA_MTMD_PYTHON;
tools/llama_mtmd_env.py makes one). ~10 s a family; bench/gguf_llama_cpp.py prints the table.

- f32 (weights at std 0.2, so the logits reach ~7 and the argmax means something): the GGUF's
  vocabulary tokenizes the prompts to transformers' ids, the logits at every position are within
  1e-3 of the largest, every argmax and 8 greedy tokens per prompt agree;
- q8_0 (the export check's own tiny models): within the check's bound, 0.1 of the largest logit;
- the LoRA adapter GGUF of a run (`export --adapter-only --format gguf`, LoRA on all-linear) on the
  base's f32 GGUF: the merged model's logits and greedy tokens, which the adapter moved far from
  the base's.
"""

from __future__ import annotations

import pytest

llama_mtmd = pytest.importorskip("llama_mtmd")
import llama_text  # noqa: E402  (after the skip: it imports llama_mtmd)

from homelab_ft.export.gguf import arch as gguf_arch  # noqa: E402
from homelab_ft.export.gguf import check as gguf_check  # noqa: E402
from homelab_ft.export.gguf import export as gguf_export  # noqa: E402

PYTHON, WHAT = llama_mtmd.runtime()
pytestmark = pytest.mark.skipif(PYTHON is None, reason=WHAT)

REFUSED = {"phimoe": "llama.cpp runs it on Phi-3's graph"}
"""The families the export refuses, with what the refusal says (gguf_layouts.GRAPH_DIFFERS)."""

WRITTEN = [case for case in llama_text.CASES if case.split("/")[0] not in REFUSED]
"""Every family of tests/families.py the export writes, and llama_text.VARIANTS (Nemotron-H with MLP
blocks beside the released MoE one)."""


def _agrees(side, *, bound: float) -> None:
    assert side.llama_tokens == side.hf_tokens  # the GGUF's vocabulary in llama.cpp: transformers' ids
    assert side.relative <= bound, f"{side.max_abs_diff:.3g} of {side.max_abs_logit:.3g}"


@pytest.mark.parametrize("model_type", WRITTEN)
def test_the_f32_gguf_runs_in_llama_cpp_as_the_model(tmp_path, model_type):
    model_dir = llama_text.f32_model(tmp_path / "f32", model_type)
    model, _ = llama_text.reference(model_dir)
    side = llama_text.compare_text(model_dir, llama_text.written_gguf(model_dir, "f32"), python=PYTHON, model=model)
    _agrees(side, bound=llama_text.F32_BOUND)
    assert side.argmax_agree == side.positions
    assert side.llama_greedy == side.hf_greedy


@pytest.mark.parametrize("model_type", WRITTEN)
def test_the_q8_0_gguf_runs_in_llama_cpp_within_the_export_checks_bound(tmp_path, model_type):
    model_dir = llama_text.q8_model(tmp_path / "q8", model_type)
    model, _ = llama_text.reference(model_dir)
    side = llama_text.compare_text(model_dir, llama_text.written_gguf(model_dir, "q8_0"), python=PYTHON, model=model)
    _agrees(side, bound=gguf_check.GGUF_BOUNDS["q8_0"])
    assert side.max_abs_diff > 0


@pytest.mark.parametrize("model_type", WRITTEN)
def test_the_adapter_gguf_on_the_base_gguf_runs_in_llama_cpp_as_the_merged_model(tmp_path, model_type):
    adapted, base = llama_text.adapter_side(tmp_path, model_type, python=PYTHON)
    _agrees(adapted, bound=llama_text.F32_BOUND)
    assert adapted.llama_greedy == adapted.hf_greedy
    assert llama_text.shift(adapted, base) > 100 * llama_text.F32_BOUND  # the adapter moves the logits (0.4-2.6)


def test_gpt_oss_departs_from_its_training_by_llama_cpps_yarn_rounding_alone(tmp_path):
    """gpt-oss turns off YaRN's rounding (rope_parameters.truncate = false), which llama.cpp always
    applies (RUNNING.md says so, gguf_rope): against the model as trained the logits move by far more
    than the bound (0.22 of the largest measured), against the same weights with the rounding on
    they are within it (7e-6)."""
    model_dir = llama_text.f32_model(tmp_path / "gpt_oss", "gpt_oss")
    gguf = llama_text.written_gguf(model_dir, "f32")
    model, note = llama_text.reference(model_dir)
    assert note
    trained = llama_text.compare_text(model_dir, gguf, python=PYTHON)
    rounded = llama_text.compare_text(model_dir, gguf, python=PYTHON, model=model)
    assert rounded.relative <= llama_text.F32_BOUND < 10 * llama_text.F32_BOUND < trained.relative


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_the_refused_families_say_why(tmp_path, model_type):
    model_dir = llama_text.f32_model(tmp_path / "f32", model_type)
    with pytest.raises(gguf_arch.GgufUnsupported, match=REFUSED[model_type]):
        gguf_export.check_writable(model_dir)
