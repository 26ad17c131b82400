"""GGUF export benchmark (not a test): seconds and peak host memory to write a GGUF vs safetensors.

    OMP_NUM_THREADS=1 .venv/bin/python bench/gguf_export.py [--rounds 2] [--skip-demo] [--skip-1b]

For the demo model (SmolLM2-135M-Instruct, fp32 on disk after its one-time conversion) and for a
random ~1.1B Llama (bf16 on disk, built here), each contender runs in its own child process, in
interleaved rounds, and is measured by that child's own rusage (os.wait4): wall seconds, CPU
seconds (user + system), peak resident memory.

- `safetensors`: what the safetensors export costs once merged: from_pretrained + save_pretrained;
- `gguf-f16`, `gguf-q8_0`: gguf_export.write_gguf (tensors streamed one at a time);
- `gguf-q8_0+check` (demo model only): the same plus verify_gguf, as `homelab-ft export` runs it.
Printed: one line per contender with the median over rounds, and the ratios to `safetensors`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import sys, json
sys.path.insert(0, {root!r})
kind, model_dir, out = sys.argv[1], sys.argv[2], sys.argv[3]
if kind == "safetensors":
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").save_pretrained(out)
else:
    from pathlib import Path
    from homelab_ft.export.gguf.check import verify_gguf
    from homelab_ft.export.gguf.export import write_gguf
    gguf_type = kind.removeprefix("gguf-").removesuffix("+check")
    path = Path(out) / f"model-{{gguf_type}}.gguf"
    Path(out).mkdir(parents=True, exist_ok=True)
    write_gguf(Path(model_dir), path, gguf_type=gguf_type, name="bench")
    if kind.endswith("+check"):
        verify_gguf(path, Path(model_dir), gguf_type=gguf_type)
"""


def run_child(kind: str, model_dir: Path, out: Path) -> dict:
    code = CHILD.format(root=str(ROOT))
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, kind, str(model_dir), str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{kind} failed:\n{err[-2000:]}")
    size = sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file() and p.suffix in (".gguf", ".safetensors"))
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_mib": usage.ru_maxrss / 1024,
            "file_mib": size / 2**20}


def make_1b(out_dir: Path) -> Path:
    """A random Llama of ~1.1B parameters (TinyLlama's shape), saved in bf16 with a tiny tokenizer.

    Built in a child process: Linux carries a process's peak RSS across fork + exec, so a parent
    that once held the 4.4 GB model would report that peak for every contender it starts."""
    if not (out_dir / "config.json").is_file():
        subprocess.run([sys.executable, __file__, "--build-1b", str(out_dir)], check=True)
    return out_dir


def _build_1b(out_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import make_tokenizer

    make_tokenizer(out_dir)
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir)


def bench(label: str, model_dir: Path, kinds: list[str], *, rounds: int, scratch: Path) -> None:
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    for round_no in range(rounds):
        for kind in kinds if round_no % 2 == 0 else reversed(kinds):  # interleaved, order alternating
            out = scratch / f"{label}-{kind}-{round_no}"
            results[kind].append(run_child(kind, model_dir, out))
            for p in out.rglob("*"):
                if p.is_file():
                    p.unlink()
    median = {k: {m: statistics.median(r[m] for r in runs) for m in runs[0]} for k, runs in results.items()}
    base = median["safetensors"]
    print(f"\n{label} ({model_dir}), median of {rounds} round(s), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    for kind, m in median.items():
        print(f"  {kind:16s} wall {m['wall_s']:6.1f} s  cpu {m['cpu_s']:6.1f} s  peak RSS {m['peak_mib']:7.0f} MiB  "
              f"file {m['file_mib']:6.0f} MiB   x safetensors: wall {m['wall_s'] / base['wall_s']:.2f}, "
              f"cpu {m['cpu_s'] / base['cpu_s']:.2f}, peak {m['peak_mib'] / base['peak_mib']:.2f}")
    print(json.dumps({label: median}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-1b", action="store_true")
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--scratch", type=Path, default=None, help="where models and outputs go (default: a temp dir)")
    parser.add_argument("--build-1b", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build_1b:
        _build_1b(args.build_1b)
        return 0
    from homelab_ft.model.loading import resolve_model_dir

    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="bench-gguf-"))
    scratch.mkdir(parents=True, exist_ok=True)
    if not args.skip_demo:
        bench("SmolLM2-135M (fp32 on disk)", resolve_model_dir("smollm2"),
              ["safetensors", "gguf-f16", "gguf-q8_0", "gguf-q8_0+check"], rounds=args.rounds, scratch=scratch)
    if not args.skip_1b:
        bench("random Llama 1.1B (bf16 on disk)", make_1b(scratch / "llama-1b"), ["safetensors", "gguf-f16", "gguf-q8_0"],
              rounds=1, scratch=scratch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
