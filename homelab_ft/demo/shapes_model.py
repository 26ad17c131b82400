"""The image demo's model: a tiny SmolVLM, random weights, SmolLM2's tokenizer.

SmolVLM-256M-Instruct is transformers' Idefics3 architecture (`Idefics3ForConditionalGeneration`,
model_type `idefics3`): a SigLIP-style vision tower, a pixel-shuffle projector (`scale_factor` 4)
and SmolLM2-135M as its language model. The demo model is that family built from configs: the text
config is the shipped SmolLM2-135M config (assets/smollm2-135m-instruct.config.json) narrowed and
shortened, the vision config a two-layer tower, and the vocabulary SmolLM2's plus the four image
tokens Idefics3's processor writes. Nothing is downloaded; the weights are random, seeded.

Why not SmolLM2-135M's own weights under a random vision tower (bench/shapes_task.py, one thread
on a shared 2-core host, shapes.py's pictures): with LoRA r 16 on the language model, the projector
and the tower, lr 2e-3, 8 rows a step, held out 22 / 23 / 29% after 50 / 100 / 150 steps (chance
22%), at ~2.9 CPU s a step; earlier layouts of the pictures stayed at chance as long. Reading a
random tower is learnt from far more pictures than a few CPU minutes give a 135M model. The tiny
model, fully fine-tuned with the tower and projector frozen (the trainer's full fine-tune,
rules/vision.freeze), read 53 / 83 / 96 / 98% after 100 / 200 / 400 / 600 steps in the same loop
(228 CPU s with its scoring), and 99% through recipes/smolvlm-shapes-cpu.yaml.

The picture (64 px) is one 8x8 grid of 8-px patches, and the projector folds each 4x4 block of
patches into one image token: 4 image tokens a picture, one per cell of shapes.py's 2x2 grid.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from homelab_ft.demo.shapes import CANVAS_PX
from homelab_ft.locate import EMBEDDED_CONFIG

log = logging.getLogger("homelab_ft.demo.shapes_model")  # also when run as __main__

SEED = 0
IMAGE_PX = CANVAS_PX
"""The pictures are read at the size they are drawn."""
SCALE_FACTOR = 4
"""Idefics3's pixel shuffle: each 4x4 block of patches becomes one token, as in SmolVLM-256M."""
VISION = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
          "image_size": IMAGE_PX, "patch_size": 8}
TEXT_SIZES = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32}
"""SmolLM2-135M is 576 wide and 30 layers deep; this keeps its family (Llama, GQA, tied embeddings,
its RoPE and norms) at 1.6M parameters besides the 49k x 128 embedding."""
IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")
"""What Idefics3Processor writes around and for an image (without image splitting)."""

# ChatML, as SmolLM2's own template, with a message's content either a string or a list of parts
# (an image part becomes <image>, which the processor expands into the image's tokens). No default
# system prompt: SmolLM2's adds 17 tokens to every row of a task that never uses it.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build(tokenizer_dir: Path, out_dir: Path, *, seed: int = SEED) -> Path:
    """The tiny Idefics3 model and its processor, saved to `out_dir`, with the tokenizer of
    `tokenizer_dir` (ChatML specials expected) and weights from `seed`. Loads back with
    AutoModelForImageTextToText and AutoProcessor."""
    import torch
    from tokenizers import AddedToken
    from transformers import (
        AutoModelForImageTextToText,
        AutoTokenizer,
        Idefics3Config,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in IMAGE_TOKENS], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Idefics3Config(
        text_config=text_config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=end_of_turn, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(VISION),
        scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = end_of_turn
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": IMAGE_PX},
                                       max_image_size={"longest_edge": IMAGE_PX})
    processor = Idefics3Processor(images, tokenizer, image_seq_len=image_seq_len(), chat_template=CHAT_TEMPLATE)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def text_config(**ids) -> dict:
    """SmolLM2-135M's config with the demo's sizes (and `ids`: vocabulary and special-token ids)."""
    config = json.loads(EMBEDDED_CONFIG.read_text(encoding="utf-8"))
    for stale in ("architectures", "torch_dtype", "transformers_version"):
        config.pop(stale, None)
    return config | TEXT_SIZES | ids


def image_seq_len() -> int:
    """Image tokens per picture: (64 / 8)^2 patches, 4x4 of them to a token."""
    return (VISION["image_size"] // VISION["patch_size"]) ** 2 // SCALE_FACTOR**2


def build_from_smollm2(out_dir: Path, *, seed: int = SEED) -> Path:
    """`build` with the embedded SmolLM2-135M-Instruct's tokenizer (its GGUF converted once, as the
    text demo's)."""
    from homelab_ft.model import loading

    return build(loading.resolve_model_dir("smollm2"), out_dir, seed=seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m homelab_ft.demo.shapes_model", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="the folder to write the model and its processor into")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    from homelab_ft import logs

    logs.configure()
    log.info("wrote %s", build_from_smollm2(args.out_dir, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
