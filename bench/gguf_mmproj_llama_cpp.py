"""GGUF + mmproj in llama.cpp's multimodal library beside transformers (not a test): the issue 35
must-show, printed side by side.

    python3 tools/llama_mtmd_env.py /tmp/llama-mtmd
    HOMELAB_FT_LLAMA_MTMD_PYTHON=/tmp/llama-mtmd/bin/python OMP_NUM_THREADS=1 \\
        .venv/bin/python bench/gguf_mmproj_llama_cpp.py [--types f32,f16,q8_0] [--tokens 16]
        [--families idefics3,qwen2_vl,qwen2_5_vl,qwen3_vl,mistral3]

A tiny random model of each family (SmolVLM v1's Idefics3, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Mistral
3; weights drawn with std 0.2 so that its greedy reply varies and its attention is not uniform) is
saved as `save_pretrained` writes a checkpoint (the folder a merged export is), written as its text
GGUF + mmproj by homelab-ft's writer for each type, and asked about a picture (Idefics3: four
coloured quadrants, 2 x 2 tiles; the others: seeded noise at a size neither side resamples): by
transformers on the folder (processor or the family's token expansion, chat template, greedy
`generate`) and by llama.cpp b11739 on the GGUF pair (mtmd tokenize, chunk evaluation, argmax).
Printed per family and type: whether the prompt tokens agree (the image's chunk included), the
largest image embedding difference, and the greedy tokens of each with how many agree. Plus, for
Gemma 3 and InternVL, the image embeddings alone (they have no chat format here). Measured
(2026-12, llama.cpp b11739): every family's f32 and f16 replies identical to transformers'; q8_0
ones drift on these std-0.2 random weights (docs/export.md).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="f32,f16,q8_0")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--families", default="idefics3,qwen2_vl,qwen2_5_vl,qwen3_vl,mistral3")
    args = parser.parse_args()

    import llama_mtmd
    from tiny_vlm import EXACT_SIDES, IMAGE, quadrants_image, save_gguf_vlm

    from homelab_ft.export.gguf.mmproj_check import probe_image

    python, what = llama_mtmd.runtime()
    if python is None:
        print(f"no llama.cpp to compare with: {what}")
        return 2
    print(f"llama.cpp: {what}")
    with tempfile.TemporaryDirectory(prefix="bench-mmproj-") as scratch:
        root = Path(scratch)
        for family in args.families.split(","):
            wide = {} if family == "idefics3" else {"initializer_range": 0.2}
            model = save_gguf_vlm(root / family, family, text_overrides={"initializer_range": 0.2}, **wide)
            if family in EXACT_SIDES:
                image = root / f"{family}.png"
                probe_image(EXACT_SIDES[family]).save(image)
            else:
                image = quadrants_image(root / "image.png")
            for gguf_type in args.types.split(","):
                _compare(llama_mtmd, family, model, image, root / f"{family}-{gguf_type}", gguf_type, python=python,
                         tokens=args.tokens)
        for model_type in ("gemma3", "internvl"):
            folder = save_gguf_vlm(root / model_type, model_type)
            gguf, mmproj, _ = _export(folder, root / f"{model_type}-f32", "f32")
            hf, llama = llama_mtmd.compare_embeddings(folder, gguf, mmproj, quadrants_image(root / "small.png", size=IMAGE),
                                                      python=python)
            print(f"\n{model_type} f32: image embeddings {tuple(llama.shape)}, max |diff| "
                  f"{float((hf - llama).abs().max()):.2e} of {float(hf.abs().max()):.3f}")
    return 0


def _compare(llama_mtmd, family: str, model: Path, image: Path, out: Path, gguf_type: str, *, python: str,
             tokens: int) -> None:
    gguf, mmproj, seconds = _export(model, out, gguf_type)
    side = llama_mtmd.compare(model, gguf, mmproj, image, python=python, max_new_tokens=tokens)
    same = sum(a == b for a, b in zip(side.hf_greedy, side.llama_greedy, strict=False))
    print(f"\n{family} {gguf_type}: written in {seconds:.1f} CPU s; prompt tokens "
          f"{'identical' if side.hf_prompt == side.llama_prompt else 'DIFFER'} ({len(side.hf_prompt)}, "
          f"{side.hf_prompt.count(-1)} image); max |embedding diff| {side.max_embedding_diff:.2e} "
          f"of {float(side.hf_embeddings.abs().max()):.2f}")
    print(f"  transformers greedy: {side.hf_greedy}")
    print(f"  llama.cpp greedy:    {side.llama_greedy}   ({same}/{len(side.hf_greedy)} agree)")


def _export(model_dir: Path, out: Path, gguf_type: str):
    """The text GGUF (unchecked here: its logit bound is calibrated on SmolLM2, and this model's
    std-0.2 weights blow f16 rounding up past it; export checks it) and the checked mmproj."""
    from homelab_ft.export.gguf import export as gguf_export
    from homelab_ft.export.gguf import image_text, text_view

    start = time.process_time()
    view = text_view.write_text_view(model_dir, out / "text")
    gguf_export.write_gguf(view, out / f"model-{gguf_type}.gguf", gguf_type=gguf_type, name="tiny")
    written = image_text.write_mmproj(model_dir, out, gguf_type=gguf_type, name="tiny", base_dir=model_dir)
    return out / f"model-{gguf_type}.gguf", out / written.file, time.process_time() - start


if __name__ == "__main__":
    sys.exit(main())
