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

from families import FAMILIES
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
    hf_logits: list = ()
    """transformers' logits of each prompt, (tokens, vocabulary)."""

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
    hf_tokens, hf_greedy, hf_logits, diff, scale, agree, positions = [], [], [], 0.0, 0.0, 0, 0
    for text, llama in zip(texts, out["prompts"], strict=True):
        ids = tokenizer(text)["input_ids"]
        hf_tokens.append(ids)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        hf_logits.append(logits)
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
                          llama_greedy=[p["greedy"] for p in out["prompts"]], llama_cpp=out["llama_cpp"],
                          hf_logits=hf_logits)


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


# ------------------------------------------------------------------- the family table (issue 38)

WIDE = 0.2
"""std of the f32 models' weights (initializer_range): with the default 0.02 a tiny model's logits
are nearly flat (largest ~1) and its greedy tokens near-ties; at 0.2 they reach ~7 and a reply is
a sequence of distinct tokens, so a layout or setting written wrong moves the argmax."""

F32_BOUND = 1e-3
"""Max |logit difference| between llama.cpp on the f32 GGUF and transformers on the merged model,
per unit of the largest |logit|. Measured (b11739, std 0.2, f32 KV cache, ggml's GELU table on
both sides): 1e-6 to 3.4e-4 on every written family; the file's own error is ~5e-6 (Llama)."""


VARIANTS = {
    "nemotron_h/dense": {"layers_block_type": ["linear_attention", "mlp", "full_attention", "mlp"]},
    "llama4_text/interleaved": {"interleave_moe_layer_step": 2, "moe_layers": [1, 3]},
}
"""Cases beside tests/families.py's, `<model_type>/<variant>`: the config they change over the
family's released one. Nemotron-H with MLP blocks (Nemotron-H 8B, Nano 9B v2: llama.cpp's
nemotron_h), where families.AS_RELEASED's has MoE blocks (Nemotron 3 Nano: nemotron_h_moe); Llama 4
with dense and MoE layers alternating (Maverick), where the default is MoE throughout (Scout)."""

CASES = (*FAMILIES, *VARIANTS)


def _released(model_type: str) -> tuple[str, dict]:
    from families import AS_RELEASED

    family = model_type.split("/")[0]
    return family, {**AS_RELEASED.get(family, {}), **VARIANTS.get(model_type, {})}


def f32_model(folder: Path, model_type: str, *, std: float = WIDE) -> Path:
    """The tiny `model_type` (a family, or one of VARIANTS) the f32 file is written from: weights at
    `std`, as released (families.AS_RELEASED) and trained (AS_TRAINED)."""
    from families import save_tiny

    family, config = _released(model_type)
    return save_tiny(folder, family, as_trained=True, initializer_range=std, **config)


def q8_model(folder: Path, model_type: str) -> Path:
    """The tiny `model_type` the q8_0 file is written from: the export check's own (default init,
    AS_RELEASED, AS_TRAINED, ALL_EXPERTS). At std WIDE a random model is chaotic enough that q8_0's
    rounding alone moves its logits past the check's bound (a tiny Llama: 0.77 against 0.69,
    through transformers), so the bound could not be held in llama.cpp either."""
    from families import ALL_EXPERTS, save_tiny

    family, config = _released(model_type)
    return save_tiny(folder, family, as_trained=True, **config, **ALL_EXPERTS.get(family, {}))


def reference(model_dir: Path):
    """(transformers' model to hold llama.cpp's run of `model_dir`'s GGUF against, why it is not the
    merged model itself or ""): gpt-oss with YaRN's correction range rounded as llama.cpp always
    rounds it (gguf_rope.yarn_rounding, said in RUNNING.md), the one difference every GGUF of it has."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from homelab_ft.export.gguf.rope import yarn_rounding

    config = AutoConfig.from_pretrained(model_dir)
    if yarn_rounding(model_dir) is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), ""
    config.rope_parameters = dict(config.rope_parameters, truncate=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32)
    return model, "YaRN rounded as llama.cpp rounds it"


def written_gguf(model_dir: Path, gguf_type: str) -> Path:
    """`model_dir` written as a GGUF of `gguf_type` beside it, named after its model type (general.name)."""
    import json

    from homelab_ft.export.gguf import export as gguf_export

    path = Path(model_dir) / f"model-{gguf_type}.gguf"
    name = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    gguf_export.write_gguf(model_dir, path, gguf_type=gguf_type, name=name)
    return path


ADAPTER_LEFT_OUT = {"deepseek_v3": ("kv_b_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa"),
                    "gemma4_text": ("per_layer_model_projection",)}
"""Layers of `lora.target_modules: all-linear` whose LoRA the adapter GGUF refuses in one line, left
out of the adapter: DeepSeek-V3's kv_b_proj (llama.cpp holds it split both ways) and the rest of its
attention's input side, Gemma 4's per-layer model projection (llama.cpp multiplies them without
adapters, gguf_layouts.Layout.lora_ignored)."""


ADAPTER_STD = 0.1
"""std of the base's weights in the adapter runs: the merged export's own check (merged vs base +
adapter in transformers, 1e-4 of the largest logit, export/merged.py) fails a random Qwen3-Next at
0.2 on the reordered sums of the merge alone (1.5e-4: such a model amplifies float rounding ~1000x),
while at 0.1 the adapter still changes every family's greedy reply."""


def adapter_targets(model_dir: Path) -> tuple[str, ...]:
    """What `lora.target_modules: all-linear` wraps on this model in a homelab-ft run
    (model/targets.resolve: attention, MLPs, shared experts, the linear-attention and Mamba
    projections PEFT can wrap; no routers, no fused experts), less ADAPTER_LEFT_OUT."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from homelab_ft.model.targets import resolve

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return tuple(t for t in resolve(model, "all-linear") if t not in ADAPTER_LEFT_OUT.get(config.model_type, ()))


def shift(side: TextSideBySide, other: TextSideBySide) -> float:
    """How far transformers' logits of one model are from another's on the same prompts, per unit of
    the largest: what an adapter changes (its merged model against the base)."""
    diff = max(float((a - b).abs().max()) for a, b in zip(side.hf_logits, other.hf_logits, strict=True))
    return diff / max(1.0, side.max_abs_logit)


def adapter_side(folder: Path, model_type: str, *, python: str, targets: tuple[str, ...] = (),
                 std: float = ADAPTER_STD) -> tuple[TextSideBySide, TextSideBySide]:
    """A LoRA run of the f32 model at `std` (random adapter on adapter_targets, build_recipe.lora_run) exported
    as the user exports it (`export RUN --adapter-only --format gguf`, and the merged safetensors):
    (llama.cpp on the base's f32 GGUF with the adapter GGUF against transformers on the merged
    model, the same without the adapter against the base: what the adapter changes)."""
    import build_recipe

    from homelab_ft.cli.main import main
    from homelab_ft.model.loading import peft_v5_targets

    model_dir = f32_model(folder / model_type.replace("/", "-"), model_type, std=std)
    with peft_v5_targets():  # the targets as written, as a homelab-ft run attaches them
        run = build_recipe.lora_run(folder, model_dir, targets=targets or adapter_targets(model_dir))
    for out, args in (("adapter", ["--adapter-only", "--format", "gguf"]), ("merged", ["--format", "safetensors"])):
        if main(["export", str(run), "--out", str(folder / out), *args]) != 0:
            raise RuntimeError(f"export {' '.join(args)} of {model_type} failed")
    base = written_gguf(model_dir, "f32")
    adapted = compare_text(folder / "merged", base, python=python, lora=folder / "adapter" / "adapter.gguf",
                           model=reference(folder / "merged")[0])
    return adapted, compare_text(model_dir, base, python=python, model=reference(model_dir)[0])
