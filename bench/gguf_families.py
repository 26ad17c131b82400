"""The GGUF family table of issue 38 (not a test): for every family of tests/families.py, a tiny
random model written as GGUF the way `homelab-ft export --format gguf` writes it, or its refusal.

    OMP_NUM_THREADS=1 .venv/bin/python bench/gguf_families.py [--families gpt_oss,qwen3_5_text]

Per family: the llama.cpp architecture; the f32 GGUF's max |logit difference| from the merged
model on the export check's two chat prompts, read back through gguf-py (the project's reader) and
through transformers' GGUF loader ("-" where transformers does not read the architecture), both
loaded into the model's own config; the default q8_0 export's check (max |logit difference| and its
bound) and its quality line (greedy next-token agreement and eval loss against the merged model on
the held-out prompts, gguf_quality.measure). The models are those the GGUF tests build
(families.AS_RELEASED; the q8_0 one with gpt-oss taking every expert, families.ALL_EXPERTS, and
Gemma 4's q/k norms as trained, families.AS_TRAINED). Printed as a
markdown table, with the seconds each family took.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def family_row(model_type: str, folder: Path) -> list[str]:
    from families import ALL_EXPERTS, AS_RELEASED, save_tiny

    from homelab_ft.export.gguf import arch as gguf_arch
    from homelab_ft.export.gguf import check as gguf_check
    from homelab_ft.export.gguf import export as gguf_export
    from homelab_ft.export.gguf import quality as gguf_quality

    released = AS_RELEASED.get(model_type, {})
    model_dir = save_tiny(folder / model_type, model_type, **released)
    names = gguf_arch.arch_candidates(model_type)
    try:
        gguf_check.check_window(model_dir, target=gguf_export.check_writable(model_dir))
    except gguf_arch.GgufUnsupported as err:
        reason = str(err).split(": ", 1)[-1]
        return [model_type, names[0] if names else "-", "refused", "", "", reason[:160]]
    f32 = model_dir / "model-f32.gguf"
    gguf_export.write_gguf(model_dir, f32, gguf_type="f32", name=model_type)
    gguf_check.verify_gguf(f32, model_dir, gguf_type="f32")
    diffs = gguf_check.reader_diffs(f32, model_dir, gguf_type="f32")
    q8_dir = save_tiny(folder / f"{model_type}-q8", model_type, as_trained=True, **released,
                       **ALL_EXPERTS.get(model_type, {}))
    q8 = q8_dir / "model-q8_0.gguf"
    gguf_export.write_gguf(q8_dir, q8, gguf_type="q8_0", name=model_type)
    check = gguf_check.verify_gguf(q8, q8_dir, gguf_type="q8_0")
    quality = gguf_quality.measure(q8, q8_dir, gguf_type="q8_0")
    shown = {name: "-" if diff is None else f"{diff:.1e}" for name, diff in diffs.items()}
    return [model_type, gguf_arch.check_architecture(model_dir).arch_name, shown["gguf-py"], shown["transformers"],
            f"{check.max_abs_diff:.1e} (bound {check.bound:.1e})",
            f"agreement {quality.agreement:.1%} on {quality.num_tokens} tokens, eval loss {quality.loss_gguf:.3f} vs "
            f"{quality.loss_merged:.3f} ({quality.loss_delta:+.3f})"]


def main() -> None:
    from families import FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    header = ["family", "llama.cpp arch", "f32 via gguf-py", "f32 via transformers", "q8_0 check", "q8_0 quality / refusal"]
    print("| " + " | ".join(header + ["s"]) + " |")
    print("|" + "---|" * (len(header) + 1))
    with tempfile.TemporaryDirectory(prefix="gguf-families-") as folder:
        for model_type in args.families.split(","):
            start = time.perf_counter()
            row = family_row(model_type, Path(folder))
            print("| " + " | ".join(row + [f"{time.perf_counter() - start:.0f}"]) + " |", flush=True)


if __name__ == "__main__":
    main()
