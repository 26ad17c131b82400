"""Every GGUF family homelab-ft writes, run in llama.cpp itself (issue 38; not a test): the table of
tests/e2e/test_gguf_llama_cpp.py, printed.

    python3 tools/llama_mtmd_env.py /tmp/llama-mtmd
    HOMELAB_FT_LLAMA_MTMD_PYTHON=/tmp/llama-mtmd/bin/python OMP_NUM_THREADS=1 \\
        .venv/bin/python bench/gguf_llama_cpp.py [--families llama,gpt_oss] [--no-adapters]

For each family of tests/families.py: a tiny random model written by homelab-ft's writer as f32
(weights at std 0.2, tests/llama_text.f32_model) and as q8_0 (the export check's own tiny model,
q8_model), each run by llama.cpp b11739's libllama (tools/llama_text.py) on the export check's two
chat prompts tokenized by the GGUF's vocabulary, against transformers on the model it was written
from. Printed per family and type: llama.cpp's architecture, max |logit difference| per unit of the
largest |logit| (f32 bound 1e-3; q8_0 the export check's, 0.1), the prompt positions whose argmax
agree, and the greedy continuation tokens equal before the first difference (8 per prompt). Then
the LoRA adapter GGUF (`export RUN --adapter-only --format gguf`, LoRA on every linear layer) on the
base's f32 GGUF against the merged model, and how far the adapter moved the logits from the base's
(per unit of the largest). A refused family prints its one-line reason. gpt-oss is compared with YaRN's correction
range rounded as llama.cpp rounds it (RUNNING.md says so); its as-trained difference is printed too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def _cells(side, *, bound: float) -> list[str]:
    return [f"{side.relative:.1e}" + ("" if side.relative <= bound else " OVER"),
            f"{side.argmax_agree}/{side.positions}", f"{side.greedy_agree}/{side.greedy_total}"]


def family_rows(model_type: str, folder: Path, *, python: str, adapters: bool) -> list[list[str]]:
    import llama_text

    from homelab_ft.export.gguf import arch as gguf_arch
    from homelab_ft.export.gguf import check as gguf_check
    from homelab_ft.export.gguf import export as gguf_export

    f32_dir = llama_text.f32_model(folder / "f32", model_type)
    try:
        target = gguf_export.check_writable(f32_dir)
    except gguf_arch.GgufUnsupported as err:
        return [[model_type, "refused", str(err).split(": ", 1)[-1][:200]]]
    rows = []
    model, note = llama_text.reference(f32_dir)
    side = llama_text.compare_text(f32_dir, llama_text.written_gguf(f32_dir, "f32"), python=python, model=model)
    rows.append([model_type, target.arch_name, "f32", *_cells(side, bound=llama_text.F32_BOUND), note])
    if note:
        trained = llama_text.compare_text(f32_dir, f32_dir / "model-f32.gguf", python=python)
        rows.append([model_type, target.arch_name, "f32", *_cells(trained, bound=llama_text.F32_BOUND),
                     "against the model as trained"])
    q8_dir = llama_text.q8_model(folder / "q8", model_type)
    model, note = llama_text.reference(q8_dir)
    side = llama_text.compare_text(q8_dir, llama_text.written_gguf(q8_dir, "q8_0"), python=python, model=model)
    rows.append([model_type, target.arch_name, "q8_0", *_cells(side, bound=gguf_check.GGUF_BOUNDS["q8_0"]), note])
    if adapters:
        adapted, base = llama_text.adapter_side(folder / "lora", model_type, python=python)
        rows.append([model_type, target.arch_name, "f32 + LoRA", *_cells(adapted, bound=llama_text.F32_BOUND),
                     f"the adapter moves the logits by {llama_text.shift(adapted, base):.2f}"
                     + ("" if base.hf_greedy != adapted.hf_greedy else ", not the greedy reply")])
    return rows


def main() -> int:
    import llama_text

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(llama_text.CASES))
    parser.add_argument("--no-adapters", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    import llama_mtmd
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    python, what = llama_mtmd.runtime()
    if python is None:
        print(f"no llama.cpp to compare with: {what}")
        return 2
    print(f"{what}; transformers beside it on the model each GGUF was written from\n")
    header = ["family", "llama.cpp arch", "GGUF", "max |diff| / max |logit|", "argmax", "greedy", "note", "s"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    with tempfile.TemporaryDirectory(prefix="gguf-llama-cpp-") as folder:
        for model_type in args.families.split(","):
            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):  # the exports' own lines (export RUN ...)
                rows = family_rows(model_type, Path(folder) / model_type.replace("/", "-"), python=python,
                                   adapters=not args.no_adapters)
            for row in rows:
                row = row + [""] * (len(header) - 1 - len(row))
                print("| " + " | ".join(row + [f"{time.perf_counter() - start:.0f}"]) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
