"""Measure one training step of an image-text model on a batch with images, in a fresh process:
`python vision_step_peak.py MODEL_DIR SPEC.json OUT.json`.

The step is the trainer's own `train_step` (train/trainer.py: the chunked loss, the optimizer step)
on the model loaded whole (`AutoModelForImageTextToText`) with LoRA on its language model
(loading.attach_lora: `all-linear` leaves the vision side out, rules/vision.py), on one micro-batch
of rows of exactly `seq_len` tokens that each carry `images` images of `side` px, built from the
model's own image processor and the image tokens the planner counts (the model refuses a wrong
count). Until the trainer reads image rows itself (issue 35 item 2), this is its step on such a batch.

The peak is bench/memory.py's: the process's resident high-water mark (VmHWM, reset through
/proc/self/clear_refs) above its RSS just before the step, after a warm-up step has made the
optimizer state, glibc serving every allocation above 128 KiB with mmap (MALLOC_MMAP_THRESHOLD_,
set by the caller) so freed tensors leave the RSS at once.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def batch(model_dir: Path, spec: dict) -> dict:
    """One micro-batch: `rows` rows of `seq_len` tokens, each `images` blank images of `side` px
    (their placeholders after a vision-start token where the family has one), the rest random text."""
    import torch
    from PIL import Image
    from transformers import AutoConfig, AutoImageProcessor
    from vision_families import IMAGE_TOKEN

    from homelab_ft.labels import IGNORE_INDEX

    config = AutoConfig.from_pretrained(model_dir)
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    rows, count, seq = spec["rows"], spec["images"], spec["seq_len"]
    image = Image.new("RGB", (spec["side"], spec["side"]))
    nested = getattr(config, "model_type", "") in ("smolvlm", "idefics3")  # batched as a list of images per row
    pixels = processor(images=[[image] * count] * rows if nested else [image] * (count * rows), return_tensors="pt")
    start = [config.vision_start_token_id] if getattr(config, "vision_start_token_id", None) else []
    generator = torch.Generator().manual_seed(0)
    ids = []
    for _ in range(rows):
        row = [token for _ in range(count) for token in (*start, *[IMAGE_TOKEN] * spec["tokens_per_image"])]
        text = torch.randint(10, 280, (seq - len(row),), generator=generator).tolist()
        ids.append(text[: len(text) // 2] + row + text[len(text) // 2:])
    input_ids = torch.tensor(ids)
    labels = input_ids.masked_fill(input_ids == IMAGE_TOKEN, IGNORE_INDEX)
    out = {"input_ids": input_ids, "labels": labels, "attention_mask": torch.ones_like(input_ids),
           "mm_token_type_ids": (input_ids == IMAGE_TOKEN).int()}
    out.update({k: v for k, v in pixels.items() if k not in ("num_crops", "num_patches")})
    return out


def main(model_dir: str, spec_path: str, out_path: str) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    from bench.memory import PeakMeter, _status_bytes
    from homelab_ft.distributed import comm
    from homelab_ft.model import loading
    from homelab_ft.recipe.config import recipe_from_dict
    from homelab_ft.rung import rung_for
    from homelab_ft.train import optim
    from homelab_ft.train.trainer import train_step

    spec = json.loads(Path(spec_path).read_text())
    recipe = recipe_from_dict(spec["recipe"])
    env = comm.setup(device_pref="cpu")
    micro = batch(Path(model_dir), spec)
    torch.manual_seed(0)
    model = loading.attach_lora(AutoModelForImageTextToText.from_pretrained(model_dir), recipe.lora)
    optimizer = optim.build_optimizer(model, recipe.train)
    session = SimpleNamespace(env=env, model=model, recipe=recipe, rung=rung_for(recipe), optimizer=optimizer,
                              scheduler=optim.build_scheduler(optimizer, recipe.train))
    train_step(session, [micro])  # the optimizer state, kernel workspaces and thread buffers
    gc.collect()
    with PeakMeter(env.device) as meter:
        result = train_step(session, [micro])
    Path(out_path).write_text(json.dumps({"peak": meter.peak, "loss": result.loss, "rss": _status_bytes("VmRSS")}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
