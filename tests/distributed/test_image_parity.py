"""Image rows on 2 gloo processes against one process on the whole batch (issue 35): a full
fine-tune sharded by FSDP2 (the vision blocks their own units, frozen), LoRA replicated by DDP and
QLoRA on the sharded 4-bit base (the tower kept in 16 bits), on a tiny Llava-NeXT whose image tokens
follow each image's size and shape (anyres tiles), so the ranks' micro-batches hold different
numbers of image tokens and pixel tiles. Beside them, text rows on a Gemma 3 checkpoint (its
causal-LM class is its image-text class, vision tower loaded and unused): FSDP2 full and FSDP2 QLoRA
train as they did before image rows existed, and equal one process.

One torchrun launch of the 2-process jobs beside one process running the references, as
test_sharded.py does; one process with micro-batch 2B sees exactly the rows 2 ranks with B see."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from procs import Workers, job_recipe, run_beside, write_chat_data
from tiny_vlm import image_chat, make_image, save_vlm

TOL = 1e-5
STEPS = 3
SIZES = ((28, 28), (56, 28), (28, 56), (60, 40), (40, 70), (56, 56))
"""Image sizes (width, height): Llava-NeXT picks a tile grid per aspect ratio, so tokens per row differ."""


def _rows(tmp: Path, num_rows: int = 24) -> str:
    names = ["red", "blue", "green"]
    colours = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30)}
    rows = []
    for i in range(num_rows):
        name, size = names[i % 3], SIZES[i % len(SIZES)]
        image = make_image(tmp / "img" / f"{name}-{size[0]}x{size[1]}.png", size=size, colour=colours[name])
        rows.append(image_chat(str(image), answer=f"it is {name}" if i % 2 else name))
    (tmp / "images.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return "images.jsonl"


def _recipe(tmp: Path, model_dir: Path, name: str, *, procs: int, method: str, strategy: str,
            images: bool = True) -> dict:
    return job_recipe(tmp, model_dir, name, procs=procs, method=method, rows="images.jsonl" if images else "text.jsonl",
                      sharding={"strategy": strategy},
                      data={"images": images, "max_length": 512, "cache_dir": str(tmp / "cache")},
                      train={"max_steps": STEPS, "micro_batch_size": 4 // procs, "grad_accum_steps": 2,
                             "lr": 1e-3 if method == "full" else 5e-3})


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("vision")
    model_dir, gemma3 = save_vlm(tmp / "llava_next", "llava_next"), save_vlm(tmp / "gemma3", "gemma3")
    _rows(tmp)
    write_chat_data(tmp / "text.jsonl", 24)
    two = {"full_fsdp": _recipe(tmp, model_dir, "full_fsdp", procs=2, method="full", strategy="full_shard"),
           "lora_ddp": _recipe(tmp, model_dir, "lora_ddp", procs=2, method="lora", strategy="no_shard"),
           "qlora_fsdp": _recipe(tmp, model_dir, "qlora_fsdp", procs=2, method="qlora", strategy="full_shard"),
           "text_full_fsdp": _recipe(tmp, gemma3, "text_full_fsdp", procs=2, method="full", strategy="full_shard",
                                     images=False),
           "text_qlora_fsdp": _recipe(tmp, gemma3, "text_qlora_fsdp", procs=2, method="qlora", strategy="full_shard",
                                      images=False)}
    one = {"ref_full": _recipe(tmp, model_dir, "ref_full", procs=1, method="full", strategy="auto"),
           "ref_lora": _recipe(tmp, model_dir, "ref_lora", procs=1, method="lora", strategy="auto"),
           "ref_qlora": _recipe(tmp, model_dir, "ref_qlora", procs=1, method="qlora", strategy="auto"),
           "text_ref_full": _recipe(tmp, gemma3, "text_ref_full", procs=1, method="full", strategy="auto", images=False),
           "text_ref_qlora": _recipe(tmp, gemma3, "text_ref_qlora", procs=1, method="qlora", strategy="auto",
                                     images=False)}
    for name, jobs in (("two", two), ("one", one)):
        (tmp / f"{name}.json").write_text(json.dumps(
            {"base_dir": str(tmp), "jobs": [{"kind": "train", "name": k, "recipe": r} for k, r in jobs.items()]}))
    run_beside(Workers(tmp / "two.json", tmp / "two.out.json", nprocs=2),
               Workers(tmp / "one.json", tmp / "one.out.json"))
    return {**json.loads((tmp / "two.out.json").read_text()), **json.loads((tmp / "one.out.json").read_text())}


@pytest.mark.parametrize("two, one", [("full_fsdp", "ref_full"), ("lora_ddp", "ref_lora"), ("qlora_fsdp", "ref_qlora"),
                                      ("text_full_fsdp", "text_ref_full"), ("text_qlora_fsdp", "text_ref_qlora")])
def test_two_processes_train_as_one_does(results, two, one):
    got, expected = results[two]["losses"], results[one]["losses"]
    assert len(got) == len(expected) == STEPS
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) <= TOL, (got, expected)
    assert expected[-1] != expected[0]  # it trained
