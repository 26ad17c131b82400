"""transformers and llama.cpp's libllama side by side on one text GGUF: the logits at every
position of the export check's chat prompts and the greedy continuation of each, for the test and
the bench that run every written family in llama.cpp itself (issue 38).

llama.cpp runs in another Python (HOMELAB_FT_LLAMA_MTMD_PYTHON, made by tools/llama_mtmd_env.py)
through tools/llama_text.py; `llama_mtmd.runtime()` says why it cannot when it cannot.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from llama_mtmd import ROOT

KV_TYPE = "f32"
"""llama.cpp's KV cache type for the comparison: its default f16 rounds every key and value, a
setting of the run rather than of the file (measured on a tiny Llama: 4.5e-6 of the largest logit
with f32, the file's own error, against ~1e-4 with f16)."""


@dataclass(frozen=True)
class TextSideBySide:
    hf_tokens: list[list[int]]
    """transformers' tokenizer's ids of each prompt."""
    llama_tokens: list[list[int]]
    """The GGUF's vocabulary's ids, tokenized by llama.cpp."""
    max_abs_diff: float
    """Largest |logit difference| over every position of every prompt."""
    max_abs_logit: float
    """Largest |logit| transformers gives there: the scale of the difference."""
    argmax_agree: int
    positions: int
    hf_greedy: list[list[int]]
    llama_greedy: list[list[int]]
    llama_cpp: str

    @property
    def relative(self) -> float:
        return self.max_abs_diff / max(1.0, self.max_abs_logit)

    @property
    def greedy_agree(self) -> int:
        """Continuation tokens equal up to the first difference, summed over the prompts."""
        same = 0
        for hf, llama in zip(self.hf_greedy, self.llama_greedy, strict=True):
            for a, b in zip(hf, llama, strict=True):
                if a != b:
                    break
                same += 1
        return same

    @property
    def greedy_total(self) -> int:
        return sum(len(tokens) for tokens in self.hf_greedy)


def compare_text(model_dir: Path, gguf_path: Path, *, python: str, lora: Path | None = None,
                 max_new_tokens: int = 8, kv_type: str = KV_TYPE, model=None, table_gelu: bool = True) -> TextSideBySide:
    """The export check's prompts (check.probe_texts: PROBE_CHATS in the model's chat template) run by
    transformers on `model_dir` (fp32) and by llama.cpp on `gguf_path` (with the LoRA GGUF `lora`
    applied where given): the tokens, the logits at every position, and `max_new_tokens` greedy
    tokens of each, no end-of-generation stop on either side. `model`: another transformers model
    to hold llama.cpp against (the GGUF as gguf-py reads it, or one computing as llama.cpp does);
    `table_gelu`: its tanh GELUs computed as ggml's CPU backend does (`as_ggml_gelu`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from homelab_ft.export.gguf.check import probe_texts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = probe_texts(tokenizer)
    request = {"model": str(gguf_path), "prompts": texts, "max_new_tokens": max_new_tokens,
               "lora": str(lora) if lora else None, "kv_type": kv_type}
    done = subprocess.run([python, str(ROOT / "tools" / "llama_text.py"), json.dumps(request)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"llama.cpp failed: {done.stderr.strip()[-2000:]}")
    out = json.loads(done.stdout)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if table_gelu:
        as_ggml_gelu(model)
    model.eval()
    hf_tokens, hf_greedy, diff, scale, agree, positions = [], [], 0.0, 0.0, 0, 0
    for text, llama in zip(texts, out["prompts"], strict=True):
        ids = tokenizer(text)["input_ids"]
        hf_tokens.append(ids)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        theirs = torch.tensor(llama["logits"])
        if theirs.shape == logits.shape:
            diff = max(diff, float((logits - theirs).abs().max()))
            agree += int((logits.argmax(-1) == theirs.argmax(-1)).sum())
        else:  # another tokenization: the logits are not comparable position by position
            diff = float("inf")
        scale, positions = max(scale, float(logits.abs().max())), positions + len(ids)
        hf_greedy.append(_greedy(model, ids, max_new_tokens))
    return TextSideBySide(hf_tokens=hf_tokens, llama_tokens=[p["tokens"] for p in out["prompts"]], max_abs_diff=diff,
                          max_abs_logit=scale, argmax_agree=agree, positions=positions, hf_greedy=hf_greedy,
                          llama_greedy=[p["greedy"] for p in out["prompts"]], llama_cpp=out["llama_cpp"])


def as_ggml_gelu(model) -> int:
    """Swap `model`'s tanh GELUs (transformers' GELUTanh, gelu_pytorch_tanh: Gemma's) for ggml's CPU
    one, returning how many: ggml-cpu's vec.h (GGML_GELU_FP16, on in its builds) rounds x to fp16
    and reads GELU(x) from a 65536-entry fp16 table (ggml_vec_gelu_f32, ggml_vec_geglu_f32), 0 below
    -10 and x above 10. That rounding of the activation is llama.cpp's, not the file's: on a tiny
    Gemma (std 0.2) it moves the logits by 9.9e-4 of the largest, 3.4e-4 with it on both sides;
    Gemma 4, whose per-layer inputs pass a GELU too, 1.65e-3 and 1.4e-4."""
    import torch
    from transformers.activations import GELUTanh

    class TableGelu(torch.nn.Module):
        def __init__(self, gelu):
            super().__init__()
            self.gelu = gelu

        def forward(self, x):
            table = self.gelu(x.to(torch.float16).float()).to(torch.float16).float()
            return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, table))

    swapped = 0
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, GELUTanh):
                setattr(module, name, TableGelu(child))
                swapped += 1
    return swapped


def _greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """Argmax continuation, the whole sequence run again each step (no cache: a tiny model)."""
    import torch

    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
    return out
