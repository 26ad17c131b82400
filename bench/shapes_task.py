"""The image task's feasibility on CPU: held-out accuracy against training steps, in a plain loop.

Trains the image demo's model (demo/shapes_model.py) on the pictures of demo/shapes.py with a plain
PyTorch loop, so the task and its setup can be measured apart from the trainer, and scores the
held-out rows (demo/shapes.score, exact answers) before training and every --every steps:

    python bench/shapes_task.py                          # tiny model, full fine-tune (the demo's setup)
    python bench/shapes_task.py --setup smollm2-lora     # SmolLM2-135M's weights under a random
                                                         # vision tower, LoRA on LM, projector, tower

`tiny-full` trains every language-model weight with the vision tower and projector frozen, as the
trainer's full fine-tune does (rules/vision.freeze). `smollm2-lora` is the alternative that
demo/shapes_model.py's docstring reports at chance. The loss is the mean over the answer's tokens and
its end of turn (the prompt, the image tokens and padding are -100). CPU seconds are this process's
(resource.getrusage): the machine is shared, wall time is noise.
"""

from __future__ import annotations

import argparse
import random
import resource
import tempfile
import time
from pathlib import Path

import torch


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def smollm2_lora_model(out_dir: Path) -> Path:
    """The tiny model's vision side and processor around SmolLM2-135M-Instruct's own weights."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, Idefics3Config

    from homelab_ft.demo import shapes_model
    from homelab_ft.model import loading

    text_dir = loading.resolve_model_dir("smollm2")
    shapes_model.build(text_dir, out_dir)
    built = Idefics3Config.from_pretrained(out_dir)
    text = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    config = Idefics3Config(text_config=text.config.to_dict() | {"vocab_size": built.text_config.vocab_size},
                            vision_config=built.vision_config.to_dict(), scale_factor=built.scale_factor,
                            image_token_id=built.image_token_id, tie_word_embeddings=True)
    torch.manual_seed(shapes_model.SEED)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.resize_token_embeddings(text.config.vocab_size)
    model.model.text_model.load_state_dict(text.model.state_dict())
    model.resize_token_embeddings(built.text_config.vocab_size)  # the image tokens' rows: the mean of the rest
    model.generation_config = AutoModelForImageTextToText.from_pretrained(out_dir).generation_config
    model.save_pretrained(out_dir)
    return out_dir


def encode(processor, row: dict, image) -> tuple[list[int], list[int], torch.Tensor]:
    """input ids, labels (-100 but on the answer and its <|im_end|>) and pixel values of one row."""
    prompt = processor.apply_chat_template(row["messages"][:1], add_generation_prompt=True)
    full = prompt + row["messages"][1]["content"] + "<|im_end|>"
    num_prompt = len(processor(text=[prompt], images=[[image]])["input_ids"][0])
    encoded = processor(text=[full], images=[[image]], return_tensors="pt")
    ids = encoded["input_ids"][0].tolist()
    return ids, [-100] * num_prompt + ids[num_prompt:], encoded["pixel_values"][0]


def collate(rows: list, pad_id: int) -> dict:
    width = max(len(ids) for ids, _, _ in rows)
    batch = {"input_ids": torch.full((len(rows), width), pad_id), "labels": torch.full((len(rows), width), -100),
             "attention_mask": torch.zeros((len(rows), width), dtype=torch.long)}
    for i, (ids, labels, _) in enumerate(rows):
        batch["input_ids"][i, : len(ids)] = torch.tensor(ids)
        batch["labels"][i, : len(ids)] = torch.tensor(labels)
        batch["attention_mask"][i, : len(ids)] = 1
    batch["pixel_values"] = torch.stack([pixels for _, _, pixels in rows])
    return batch


def trainable(model, setup: str, rank: int):
    from peft import LoraConfig, get_peft_model

    from homelab_ft.rules import vision

    if setup == "tiny-full":
        assert vision.freeze(model) > 0, "the trainer's full fine-tune freezes the tower and projector"
        return model
    targets = (r".*(text_model\..*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
               r"|vision_model\..*\.(q_proj|k_proj|v_proj|out_proj|fc1|fc2)|modality_projection\.proj)")
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", choices=("tiny-full", "smollm2-lora"), default="tiny-full")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="the data order's")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from homelab_ft.demo import shapes, shapes_model

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="shapes-task-"))
    model_dir = (shapes_model.build_from_smollm2 if args.setup == "tiny-full" else smollm2_lora_model)(work / "model")
    train_file, eval_file = shapes.write_dataset(work / "data")
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    held_out = shapes.read_rows(eval_file)
    start_cpu, start_wall = cpu_seconds(), time.perf_counter()

    def report(step: int) -> None:
        result = shapes.score(model, processor, held_out, data_file=eval_file)
        print(f"step {step:4d}  held-out {result.summary()}  cpu {cpu_seconds() - start_cpu:.0f}s "
              f"wall {time.perf_counter() - start_wall:.0f}s", flush=True)

    report(0)
    rows = [encode(processor, example.row, example.image)
            for example in shapes.make_rows("train", num_rows=shapes.NUM_TRAIN_ROWS)]
    model = trainable(model, args.setup, args.rank)
    params = [p for p in model.parameters() if p.requires_grad]
    print(f"{args.setup}: {sum(p.numel() for p in params):,} trained parameters, {len(rows)} training rows, "
          f"{sum(len(ids) for ids, _, _ in rows) / len(rows):.1f} tokens a row", flush=True)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, 1 - s / args.steps))
    order, rng = [], random.Random(args.seed)
    torch.manual_seed(args.seed)
    model.train()
    for step in range(1, args.steps + 1):
        if len(order) < args.batch:
            order += rng.sample(range(len(rows)), len(rows))
        picked, order = order[: args.batch], order[args.batch :]
        loss = model(**collate([rows[i] for i in picked], processor.tokenizer.pad_token_id)).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % args.every == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.3f}", flush=True)
            report(step)
            model.train()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
