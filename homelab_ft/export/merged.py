"""The merged model of an adapter run: written (one safetensors file at a time through merge.py,
or PEFT's in-memory merge where merge.py cannot stream), reloaded with plain transformers and its
logits compared with base + adapter before export reports it done; and the adapter alone.

Split from run.py, which decides what an export holds; this module only makes and checks weights.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from homelab_ft import fsio
from homelab_ft.errors import UserError
from homelab_ft.export import expert_adapters, merge
from homelab_ft.model import loading
from homelab_ft.store import checkpoint

log = logging.getLogger(__name__)

FP32_TOLERANCE = 1e-4
"""Max abs logit difference allowed between the merged export and base + adapter in fp32, per
unit of the largest logit's magnitude (1e-4 flat when logits stay within +-1)."""


def load_base_with_adapter(ckpt: Path, model_dir: Path, recipe, *, dtype=None, images: bool = False):
    """The base in full precision (`dtype`, default fp32), built as the run built it (`images`: the
    image-text model, rules/vision.py) + the checkpoint's adapter."""
    import torch
    from peft import PeftModel

    base = loading.load_model(recipe.model, model_dir, dtype=dtype or torch.float32, device=torch.device("cpu"),
                              images=images)
    try:
        with loading.peft_v5_targets():
            model = PeftModel.from_pretrained(base, ckpt / checkpoint.ADAPTER)
        expert_adapters.attach(model, ckpt / checkpoint.ADAPTER, cfg=merge.adapter_config(ckpt / checkpoint.ADAPTER))
        expert_adapters.attach_routers(model, ckpt / checkpoint.ADAPTER)
        return model
    except (RuntimeError, ValueError, KeyError) as err:
        raise UserError(
            f"the adapter in {ckpt} does not fit the base {recipe.model.path} "
            f"({str(err).splitlines()[0][:160]}); export it against the model it was trained on"
        ) from None


def write_merged(ckpt: Path, model_dir: Path, recipe, out: Path, *, dtype: str, name: str, images: bool = False) -> float:
    """The adapter merged into the base, one base safetensors file at a time (merge.py), then
    checked. Adapters merge.py cannot stream take PEFT's in-memory merge (`write_merged_in_memory`).
    `images`: an image run's adapter, named after the image-text model, checked with an image."""
    from homelab_ft.host import available_ram_bytes

    remote = recipe.model.trust_remote_code
    reason = merge.unsupported_reason(ckpt / checkpoint.ADAPTER, model_dir, trust_remote_code=remote, images=images)
    if reason is not None:
        log.info("export: %s, so the adapter is merged in memory with PEFT", reason)
        return write_merged_in_memory(ckpt, model_dir, recipe, out, dtype=dtype, name=name, images=images)

    save_dtype = saved_dtype(dtype, model_dir)
    stats = merge.merge_files(ckpt / checkpoint.ADAPTER, model_dir, out, dtype=save_dtype, trust_remote_code=remote,
                              images=images)
    loading.load_tokenizer(recipe.model, model_dir).save_pretrained(out)
    copy_processor_files(model_dir, out)
    log.info("export: merged %d adapted weights file by file (%d base file(s), %s)", stats["merged"], stats["files"],
             save_dtype)
    # The logit check loads base + adapter and then the export, one after the other; a model too
    # big for that (a 70B is 141 GB in bf16) gets its merged weights re-read and recomputed instead.
    # Two models in memory one after the other, each up to twice its file size (bf16 read as fp32).
    if 4 * merge.base_bytes(model_dir) < available_ram_bytes():
        return check_logits(ckpt, model_dir, recipe, out, save_dtype=save_dtype, images=images)
    worst = merge.check_written(ckpt / checkpoint.ADAPTER, model_dir, out, dtype=save_dtype, trust_remote_code=remote,
                                images=images)
    if worst > 0:
        raise RuntimeError(f"export check failed: a merged weight read back differs by {worst:.2e} from base + adapter")
    log.info("export check: merged weights read back equal base + adapter (model too large for a logit check here)")
    return worst


def check_logits(ckpt: Path, model_dir: Path, recipe, out: Path, *, save_dtype, images: bool = False) -> float:
    """Logits of the written export against base + adapter on a chat-formatted probe (with an image,
    read by the export's own processor, for an image run)."""
    import gc

    import torch

    peft_model = load_base_with_adapter(ckpt, model_dir, recipe, dtype=save_dtype, images=images)
    peft_model.eval()
    probe = probe_inputs(model_dir, recipe, images=images)
    with torch.no_grad():
        expected = peft_model(**probe).logits.float()
    del peft_model
    gc.collect()
    return judge(reloaded_logits(out, recipe, probe, save_dtype=save_dtype, images=images), expected,
                 save_dtype=save_dtype)


def reloaded_logits(out: Path, recipe, probe: dict, *, save_dtype, images: bool):
    """The export's logits on `probe`, loaded as a user loads it: the auto class the run built
    (AutoModelForImageTextToText for an image run, whose probe the export's processor must read alike)."""
    import torch

    from homelab_ft.model import family
    from homelab_ft.rules import vision

    config = family.config_of(out, trust_remote_code=recipe.model.trust_remote_code)
    if images and not all(torch.equal(v, probe[k]) for k, v in probe_inputs(out, recipe, images=True).items()):
        raise RuntimeError("export check failed: the exported processor reads the probe image differently from the base's")
    reloaded = vision.auto_class(config, images=images).from_pretrained(out, dtype=save_dtype)
    with torch.no_grad():
        return reloaded(**probe).logits.float()


def judge(got, expected, *, save_dtype) -> float:
    import torch

    diff = float((got - expected).abs().max())
    # In fp32, merging only reorders sums: relative errors of ~1e-7 per op that grow through the
    # layers, ~1e-4 on SmolLM2's logits of magnitude ~25 (measured 8e-5..1.0e-4). So the bound is
    # 1e-4 per unit of logit magnitude (1e-4 flat for logits within +-1). In bf16 the merged weight
    # is rounded once more; the bound there only catches real mistakes (a wrong or missing adapter
    # moves logits by whole units).
    scale = float(expected.abs().max())
    tolerance = FP32_TOLERANCE * max(1.0, scale) if save_dtype == torch.float32 else 0.05 * scale
    if diff > tolerance:
        raise RuntimeError(f"export check failed: merged logits differ from base + adapter by {diff:.2e} > {tolerance:.2e}")
    log.info("export check: max |logit difference| merged vs base + adapter = %.2e (%s)", diff, save_dtype)
    return diff


def write_merged_in_memory(ckpt: Path, model_dir: Path, recipe, out: Path, *, dtype: str, name: str,
                           images: bool = False) -> float:
    """PEFT's merge_and_unload, in the dtype the export is saved in (fp32, or the base's bf16/fp16
    that the weights were published in): an 8B model then needs 16 GB of host RAM, not 32 GB."""
    import gc

    import torch

    save_dtype = saved_dtype(dtype, model_dir)
    peft_model = load_base_with_adapter(ckpt, model_dir, recipe, dtype=save_dtype, images=images)
    peft_model.eval()
    tokenizer = loading.load_tokenizer(recipe.model, model_dir)
    probe = probe_inputs(model_dir, recipe, images=images)
    with torch.no_grad():
        expected = peft_model(**probe).logits.float()
    expert_adapters.merge_in_memory(peft_model)
    merged = peft_model.merge_and_unload()
    merged.config.use_cache = True
    # 5 GB shards: the size the Hub and llama.cpp's converter handle comfortably.
    merged.save_pretrained(out, max_shard_size="5GB")
    fsio.as_folder_files(*Path(out).glob("*.safetensors"))
    tokenizer.save_pretrained(out)
    copy_processor_files(model_dir, out)
    del merged, peft_model  # one copy of the weights in memory at a time
    gc.collect()
    return judge(reloaded_logits(out, recipe, probe, save_dtype=save_dtype, images=images), expected,
                 save_dtype=save_dtype)


def write_adapter(ckpt: Path, model_dir: Path, recipe, out: Path, *, images: bool = False) -> None:
    """The adapter alone, for runtimes that serve base + adapter (vLLM, llama.cpp --lora)."""
    beyond = expert_adapters.outside_peft(ckpt / checkpoint.ADAPTER)
    if beyond:
        raise UserError(f"export --adapter-only: this adapter holds {beyond}, which PEFT's format cannot hold; "
                        "export the merged model (drop --adapter-only)")
    load_base_with_adapter(ckpt, model_dir, recipe, images=images)  # refuses an adapter that does not fit the base
    shutil.copytree(ckpt / checkpoint.ADAPTER, out, dirs_exist_ok=True)
    config_path = out / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = recipe.model.path
    config_path.write_text(json.dumps(config, indent=2))
    loading.load_tokenizer(recipe.model, model_dir).save_pretrained(out)
    copy_processor_files(model_dir, out)
    return None


def saved_dtype(name: str, model_dir: Path):
    import torch

    if name != "auto":
        return getattr(torch, name)
    config = json.loads((model_dir / "config.json").read_text())
    declared = config.get("dtype") or config.get("torch_dtype")  # the name differs across transformers versions
    return getattr(torch, declared) if declared in ("float32", "bfloat16", "float16") else torch.float32


def processor_files(model_dir: Path) -> list[Path]:
    """The base's processor files (an image-text checkpoint's image and video processor settings,
    the processor's own config and chat template), as transformers names them; [] for a text model."""
    from transformers.utils import (
        CHAT_TEMPLATE_FILE,
        IMAGE_PROCESSOR_NAME,
        LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE,
        PROCESSOR_NAME,
        VIDEO_PROCESSOR_NAME,
    )

    names = (PROCESSOR_NAME, IMAGE_PROCESSOR_NAME, VIDEO_PROCESSOR_NAME, CHAT_TEMPLATE_FILE,
             LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE)
    return [Path(model_dir) / n for n in names if (Path(model_dir) / n).is_file()]


def copy_processor_files(model_dir: Path, out: Path) -> None:
    """The base's processor files into the export, as they are (training changes none of them), so
    `AutoProcessor.from_pretrained(out)` reads images as the base's processor did."""
    for path in processor_files(model_dir):
        shutil.copyfile(path, Path(out) / path.name)  # a new file: the mode of its folder


PROBE_SIZE = (64, 48)
"""The probe image's width and height: a gradient, so every patch differs, not square, so a
processor's resize and tiling paths run."""


def probe_inputs(model_dir: Path, recipe, *, images: bool) -> dict:
    """The model inputs the export is checked on: a chat-formatted question, and for an image run an
    image with it, read by the processor in `model_dir` (the base's, or the export's)."""
    if not images:
        return {"input_ids": probe_ids(loading.load_tokenizer(recipe.model, model_dir))}
    from PIL import Image

    _, processor = loading.load_tokenizer_and_processor(recipe.model, model_dir, images=True)
    image = Image.linear_gradient("L").resize(PROBE_SIZE).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this image?"}]}]
    text = (processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            if processor.chat_template else processor.image_token + "What is in this image?")
    return dict(processor(text=[text], images=[[image]], return_tensors="pt"))


def probe_ids(tokenizer):
    import torch

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
