"""transformers and llama.cpp's multimodal library side by side on one image-text model: the prompt
tokens, the image embeddings and the greedy continuation of each, for the test and the bench that
compare a GGUF + mmproj export with the merged model it came from.

llama.cpp runs in another Python (HOMELAB_FT_LLAMA_MTMD_PYTHON, made by tools/llama_mtmd_env.py)
through tools/llama_mtmd.py; `runtime()` says why it cannot when it cannot.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from homelab_ft.export.gguf.mmproj_check import image_features

ROOT = Path(__file__).resolve().parents[1]
ENV = "HOMELAB_FT_LLAMA_MTMD_PYTHON"


def runtime() -> tuple[str | None, str]:
    """(the Python that has llama.cpp's libmtmd, or None; what it is, or why there is none)."""
    python = os.environ.get(ENV)
    if not python:
        return None, f"{ENV} is not set (make one with: python3 tools/llama_mtmd_env.py VENV)"
    probe = subprocess.run([python, "-c", "from llama_cpp_py_sync._cffi_bindings import get_mtmd_lib; get_mtmd_lib(); "
                            "import llama_cpp_py_sync as l; print(l.__llama_cpp_tag__)"], capture_output=True, text=True)
    if probe.returncode:
        return None, f"{python} cannot load llama.cpp's libmtmd: {(probe.stderr.strip().splitlines() or ['?'])[-1]}"
    return python, f"llama.cpp {probe.stdout.strip()}"


@dataclass
class SideBySide:
    hf_prompt: list[int]
    """transformers' input ids, each image token as -1."""
    llama_prompt: list[int]
    """mtmd's chunks flattened the same way."""
    hf_embeddings: object
    llama_embeddings: object
    hf_greedy: list[int]
    llama_greedy: list[int]
    llama_cpp: str

    @property
    def max_embedding_diff(self) -> float:
        return float((self.hf_embeddings - self.llama_embeddings).abs().max())


def compare(model_dir: Path, gguf_path: Path, mmproj_path: Path, image: Path, *, python: str,
            max_new_tokens: int = 12, lora: Path | None = None,
            image_tokens: tuple[int, int] | None = None) -> SideBySide:
    """One user turn holding `image` and a question, rendered by the model's chat template (and its
    processor, where one loads here), run greedily by transformers (`model_dir`) and by llama.cpp
    (the GGUF pair, with the LoRA GGUF `lora` applied where given, images sized into `image_tokens`
    as llama.cpp's --image-min-tokens / --image-max-tokens size them)."""
    import inspect

    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in the picture?"}]}]
    text, inputs, chunk_tokens = _hf_inputs(model_dir, model.config, chat, image)
    ids = inputs["input_ids"][0].tolist()
    wanted = set(inspect.signature(model.get_image_features).parameters)
    with torch.no_grad():
        features = image_features(model.get_image_features(**{k: v for k, v in inputs.items() if k in wanted}))
        generated = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)[0, len(ids):].tolist()
        table = model.get_input_embeddings().weight.detach()
    request = {"model": str(gguf_path), "mmproj": str(mmproj_path), "image": str(image), "prompt": text,
               "max_new_tokens": max_new_tokens, "lora": str(lora) if lora else None, "image_tokens": image_tokens}
    done = subprocess.run([python, str(ROOT / "tools" / "llama_mtmd.py"), json.dumps(request)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"llama.cpp failed: {done.stderr.strip()[-2000:]}")
    out = json.loads(done.stdout)
    llama_prompt, embeddings = [], []
    for chunk in out["chunks"]:
        llama_prompt += [-1] * chunk["n"] if chunk["type"] == "image" else chunk["tokens"]
        embeddings += chunk.get("embeddings", [])
    # what the language model receives at the image's positions: a feature row per image token, the
    # token's own embedding for the others the image's chunk holds (Pixtral's [IMG_BREAK])
    rows, next_feature = [], iter(features)
    for token in ids:
        if token in chunk_tokens:
            rows.append(next(next_feature) if token == model.config.image_token_id else table[token])
    return SideBySide(
        hf_prompt=[-1 if token in chunk_tokens else token for token in ids], llama_prompt=llama_prompt,
        hf_embeddings=torch.stack(rows), llama_embeddings=torch.tensor(embeddings),
        hf_greedy=generated, llama_greedy=out["greedy"], llama_cpp=out["llama_cpp"])


def _hf_inputs(model_dir: Path, config, chat: list, image: Path):
    """(the prompt for llama.cpp, `<image>` where the image goes; transformers' inputs; the token ids
    of the image's chunk in llama.cpp). Through the family's processor where it loads here, else
    (Qwen-VL, Mistral 3: their processors need torchvision) the template's image markup expanded to
    the image's tokens as the processor would (EXPANSIONS)."""
    from PIL import Image
    from tiny_vlm import IMAGE_MARKUP
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    from homelab_ft.export.gguf.mmproj import projector_for

    if config.model_type not in EXPANSIONS:
        processor = AutoProcessor.from_pretrained(model_dir)
        text = processor.apply_chat_template(chat, add_generation_prompt=True)
        return text, processor(text=text, images=[Image.open(image)], return_tensors="pt"), {processor.image_token_id}
    import torch

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    markup = IMAGE_MARKUP[config.model_type]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    pixels = dict(AutoImageProcessor.from_pretrained(model_dir)(images=[Image.open(image)], return_tensors="pt"))
    before, after = text.split(markup)
    image_ids = EXPANSIONS[config.model_type](tokenizer, config, pixels)
    ids = tokenizer(before)["input_ids"] + image_ids + tokenizer(after)["input_ids"]
    inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long), **pixels}
    if "image_grid_thw" in pixels:  # M-RoPE's positions are computed where this marks the image tokens
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == config.image_token_id).int()
    chunk = {config.image_token_id, *(tokenizer.convert_tokens_to_ids(t) for _, t in projector_for(config)[1].token_rows)}
    return before + "<image>" + after, inputs, chunk


def _qwen_image(tokenizer, config, pixels) -> list[int]:
    """Qwen2VLProcessor's expansion: <|vision_start|>, one image token per merged patch, <|vision_end|>."""
    merge = config.vision_config.spatial_merge_size
    count = int(pixels["image_grid_thw"].prod()) // merge**2
    return [config.vision_start_token_id, *[config.image_token_id] * count, config.vision_end_token_id]


def _pixtral_image(tokenizer, config, pixels) -> list[int]:
    """PixtralProcessor's expansion (processing_pixtral.py): each row of merged patches is its image
    tokens and [IMG_BREAK], the last row ending in [IMG_END] instead."""
    side = config.vision_config.patch_size * config.spatial_merge_size
    height, width = (int(v) // side for v in pixels["image_sizes"][0])
    brk, end = tokenizer.convert_tokens_to_ids(["[IMG_BREAK]", "[IMG_END]"])
    rows = [[config.image_token_index] * width + [brk] for _ in range(height)]
    rows[-1][-1] = end
    return [token for row in rows for token in row]


EXPANSIONS = {"qwen2_vl": _qwen_image, "qwen2_5_vl": _qwen_image, "qwen3_vl": _qwen_image, "mistral3": _pixtral_image}


def compare_embeddings(model_dir: Path, gguf_path: Path, mmproj_path: Path, image: Path, *, python: str):
    """(transformers' image features, llama.cpp's image embeddings) of `image`, for a model with an
    image processor but no chat format: the features are what the language model receives."""
    import inspect

    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    wanted = set(inspect.signature(model.get_image_features).parameters)
    inputs = {k: v for k, v in AutoImageProcessor.from_pretrained(model_dir)(images=[Image.open(image)],
                                                                             return_tensors="pt").items() if k in wanted}
    with torch.no_grad():
        features = image_features(model.get_image_features(**inputs))
    request = {"model": str(gguf_path), "mmproj": str(mmproj_path), "image": str(image), "prompt": "<image>",
               "max_new_tokens": 1}
    done = subprocess.run([python, str(ROOT / "tools" / "llama_mtmd.py"), json.dumps(request)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"llama.cpp failed: {done.stderr.strip()[-2000:]}")
    embeddings = [e for chunk in json.loads(done.stdout)["chunks"] for e in chunk.get("embeddings", [])]
    return features, torch.tensor(embeddings)
