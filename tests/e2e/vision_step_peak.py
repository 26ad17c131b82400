"""Run `homelab-ft train RECIPE --run-dir RUN` in a fresh process and measure the peak memory of its
second step: `python vision_step_peak.py RECIPE RUN OUT.json [RECIPE RUN OUT.json ...]`, one run after
another (each peak is above the RSS just before its own step, so a run before it does not count).

Everything is the CLI's own: the plan (with the image rows `data inspect` measured before,
cli/plan.measured_rows), the checked inputs, the model the trainer builds for the chosen rung, the
rows its data pipeline prepared (prepare_for on image rows: the processor's tokens, the pixels read
again per batch by PixelBatcher) and the micro-batch its sampler draws. Only the trainer's
`train_step` is wrapped, to meter its second call: the first has made the optimizer state,
kernel workspaces and thread buffers.

The peak is bench/memory.py's: the process's resident high-water mark (VmHWM, reset through
/proc/self/clear_refs) above its RSS just before the step, glibc serving every allocation above
128 KiB with mmap (MALLOC_MMAP_THRESHOLD_, set by the caller) so freed tensors leave the RSS at once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(recipe: str, run_dir: str, out_path: str) -> None:
    from bench.memory import PeakMeter
    from homelab_ft.cli.main import main as cli
    from homelab_ft.train import trainer

    real_step, peaks = trainer.train_step, []

    def metered(session, micro_batches):
        if len(peaks) != 1:
            peaks.append(None)
            return real_step(session, micro_batches)
        with PeakMeter(session.env.device) as meter:
            result = real_step(session, micro_batches)
        peaks.append(meter.peak)
        shapes = {k: list(v.shape) for batch in micro_batches for k, v in batch.items() if hasattr(v, "shape")}
        Path(out_path).write_text(json.dumps({"peak": meter.peak, "loss": result.loss, "batch": shapes}))
        return result

    trainer.train_step = metered
    try:
        if cli(["train", recipe, "--run-dir", run_dir]) != 0:
            raise SystemExit("homelab-ft train failed")
    finally:
        trainer.train_step = real_step


if __name__ == "__main__":
    import gc

    args = sys.argv[1:]
    for i in range(0, len(args), 3):
        main(*args[i:i + 3])
        gc.collect()  # the last run's cycles freed before the next one's baseline
