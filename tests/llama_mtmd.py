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
            max_new_tokens: int = 12) -> SideBySide:
    """One user turn holding `image` and a question, rendered by the model's processor and chat
    template, run greedily by transformers (`model_dir`) and by llama.cpp (the GGUF pair)."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in the picture?"}]}]
    text = processor.apply_chat_template(chat, add_generation_prompt=True)
    inputs = processor(text=text, images=[Image.open(image)], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        features = model.get_image_features(pixel_values=inputs["pixel_values"],
                                            pixel_attention_mask=inputs.get("pixel_attention_mask"))
        features = getattr(features, "pooler_output", features)
        generated = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)[0, len(ids):].tolist()
    request = {"model": str(gguf_path), "mmproj": str(mmproj_path), "image": str(image),
               "prompt": text,
               "max_new_tokens": max_new_tokens}
    done = subprocess.run([python, str(ROOT / "tools" / "llama_mtmd.py"), json.dumps(request)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"llama.cpp failed: {done.stderr.strip()[-2000:]}")
    out = json.loads(done.stdout)
    llama_prompt, embeddings = [], []
    for chunk in out["chunks"]:
        llama_prompt += [-1] * chunk["n"] if chunk["type"] == "image" else chunk["tokens"]
        embeddings += chunk.get("embeddings", [])
    parts = list(features) if isinstance(features, list | tuple) else [features]
    return SideBySide(
        hf_prompt=[-1 if token == processor.image_token_id else token for token in ids], llama_prompt=llama_prompt,
        hf_embeddings=torch.cat([p.reshape(-1, p.shape[-1]) for p in parts]), llama_embeddings=torch.tensor(embeddings),
        hf_greedy=generated, llama_greedy=out["greedy"], llama_cpp=out["llama_cpp"])


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
        features = model.get_image_features(**inputs)
    features = getattr(features, "pooler_output", features)
    parts = list(features) if isinstance(features, list | tuple) else [features]
    request = {"model": str(gguf_path), "mmproj": str(mmproj_path), "image": str(image), "prompt": "<image>",
               "max_new_tokens": 1}
    done = subprocess.run([python, str(ROOT / "tools" / "llama_mtmd.py"), json.dumps(request)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"llama.cpp failed: {done.stderr.strip()[-2000:]}")
    embeddings = [e for chunk in json.loads(done.stdout)["chunks"] for e in chunk.get("embeddings", [])]
    return torch.cat([p.reshape(-1, p.shape[-1]) for p in parts]), torch.tensor(embeddings)
