"""Export a run as a model that plain `transformers`, llama.cpp and other local runtimes load.

Adapters are merged into a full-precision copy of the base, never into 4-bit weights (merging
into NF4 re-quantizes the sum and throws away most of what the adapter learned). The export is
written into a staging folder beside `--out` (target.py: locked, removed on a signal, a full disk
or a read-only target), checked by reloading it with `from_pretrained` and comparing its logits
with the unmerged model, and only then swapped into place. Running it again for the same
checkpoint does nothing.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from homelab_ft.errors import UserError
from homelab_ft.export import local_runtimes, merged, target
from homelab_ft.export.gguf import arch as gguf_arch
from homelab_ft.export.gguf import check as gguf_check
from homelab_ft.export.gguf import export as gguf_export
from homelab_ft.export.gguf import image_text
from homelab_ft.export.gguf import quality as gguf_quality
from homelab_ft.model import files, loading
from homelab_ft.recipe.config import Recipe
from homelab_ft.rung import Rung
from homelab_ft.store import checkpoint, runlock
from homelab_ft.store.layout import RunDir, RunInfo

log = logging.getLogger(__name__)

META = "homelab_ft_export.json"
ADAPTER_GGUF = "adapter.gguf"
"""llama.cpp's LoRA file, what --adapter-only --format gguf writes."""


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    max_abs_diff: float | None
    skipped: bool
    gguf_path: Path | None = None
    quantize_hint: str | None = None
    """The llama-quantize command that makes the k-quant asked for from the written f16 GGUF."""
    quality: gguf_quality.GgufQuality | None = None
    """What the quantized GGUF costs against the merged model, measured on the run's eval rows."""


@dataclass(frozen=True)
class _Request:
    """What the command line asked for, checked before the run directory is read."""

    formats: tuple[str, ...]
    adapter_only: bool
    dtype: str
    gguf_type: str | None
    """The GGUF type written for a merged model (f16 when a k-quant was asked for); None: no model GGUF."""
    k_quant: str | None

    @property
    def safetensors(self) -> bool:
        return "safetensors" in self.formats

    @property
    def adapter_gguf(self) -> str | None:
        """Written instead of a model GGUF by --adapter-only --format gguf."""
        return ADAPTER_GGUF if self.adapter_only and "gguf" in self.formats else None

    @property
    def gguf_name(self) -> str | None:
        return gguf_export.gguf_file_name(self.gguf_type) if self.gguf_type else self.adapter_gguf


@dataclass(frozen=True)
class _Source:
    """The run being exported: its rung (from run.json), recipe and newest intact checkpoint (held
    against pruning while the export reads it: checkpoint.reading)."""

    info: RunInfo
    recipe: Recipe
    ckpt: Path

    @property
    def rung(self) -> Rung:
        return self.info.rung


def export_run(
    run_dir: Path,
    out_dir: Path,
    *,
    adapter_only: bool = False,
    dtype: str = "auto",
    overwrite: bool = False,
    formats: str = "safetensors",
    gguf_type: str | None = None,
    trust_remote_code: bool = False,
    eval_rows: Callable[[], list[dict] | None] | None = None,
) -> ExportResult:
    """`trust_remote_code` is the command line's flag: a run directory is data, possibly copied
    from elsewhere, so its recipe alone never makes export run code shipped with a model.
    `eval_rows` gives the run's tokenized eval rows that a quantized GGUF is measured on; it is
    called only once one is written (export may not import the data stage, and a refused or
    skipped export never reads the data).

    The checkpoint is held against the trainer's pruning while it is read (a run may still be
    training), and `out_dir` is written as target.py says: locked, staged, swapped in when complete."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    request = _check_request(formats, adapter_only=adapter_only, dtype=dtype, gguf_type=gguf_type)
    target.check_out(out_dir)
    info, recipe = _open_run(run_dir, request, trust_remote_code=trust_remote_code)
    target.check_not_the_base(out_dir, Path(info.model_dir))
    model_dir = loading.resolve_model_dir(recipe.model.path) if request.gguf_name else None
    request, no_gguf = _without_unwritable_gguf(request, model_dir)
    with checkpoint.reading(run_dir) as ckpt:
        if ckpt is None:
            training = runlock.in_use(run_dir)
            raise UserError(f"{run_dir} is training ({training}) and has no complete checkpoint yet; export it after "
                            "its first save (train.save_every)" if training else
                            f"{run_dir} has no complete checkpoint to export; train it first (or resume it)")
        with target.writing(out_dir) as out:
            result = _export(_Source(info=info, recipe=recipe, ckpt=ckpt), request, out, overwrite=overwrite,
                             eval_rows=eval_rows, model_dir=model_dir)
    _refuse_gguf(no_gguf, out_dir)  # after the safetensors asked beside it are in place
    return result


def _export(source: _Source, request: _Request, out: target.Target, *, overwrite: bool,
            eval_rows: Callable[[], list[dict] | None] | None, model_dir: Path | None) -> ExportResult:
    """The export itself, with `out` locked: nothing to do when it already holds this export."""
    out_dir = out.out
    identity = _identity(source.ckpt, request)
    hint = gguf_export.quantize_command(out_dir / request.gguf_name, request.k_quant) if request.k_quant else None
    if _recorded_source(out_dir) == identity:
        log.info("%s already holds this export; nothing to do", out_dir)
        return ExportResult(out_dir, None, skipped=True, quantize_hint=hint)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise UserError(f"{out_dir} already exists and holds something else; pass --overwrite or another --out")

    model_dir = model_dir or loading.resolve_model_dir(source.recipe.model.path)
    files.check_model_files(model_dir)  # the merge streams the base's safetensors: a damaged one is one line here
    tmp = out.begin()
    record, quality = _write_export(tmp, source=source, request=request, model_dir=model_dir, name=out_dir.name,
                                    hint=hint, eval_rows=eval_rows)
    (tmp / META).write_text(json.dumps({"source": identity, **record}, indent=1))
    out.commit()
    gguf_path = out_dir / request.gguf_name if "gguf" in record else None
    return ExportResult(out_dir, record["max_abs_diff"], skipped=False, gguf_path=gguf_path, quantize_hint=hint,
                        quality=quality)


def _recorded_source(out_dir: Path) -> dict | None:
    """What the export in `out_dir` was made from (META), or None: none there, or not readable as ours."""
    try:
        return json.loads((out_dir / META).read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None


def _check_request(formats: str, *, adapter_only: bool, dtype: str, gguf_type: str | None) -> _Request:
    """The option refusals that need no run directory."""
    wanted = gguf_export.parse_formats(formats)
    if gguf_type is not None and "gguf" not in wanted:
        raise UserError("--gguf-type needs --format gguf (or --format safetensors,gguf)")
    if adapter_only and gguf_type is not None:
        raise UserError("--gguf-type does not apply to --adapter-only (the adapter GGUF is written in f32)")
    written, k_quant = (gguf_export.check_gguf_type(gguf_type) if "gguf" in wanted and not adapter_only
                        else (None, None))
    return _Request(formats=wanted, adapter_only=adapter_only, dtype=dtype, gguf_type=written, k_quant=k_quant)


def _without_unwritable_gguf(request: _Request, model_dir: Path | None) -> tuple[_Request, UserError | None]:
    """The request less its GGUF when homelab-ft cannot write this model as one (decided from the
    base's config, tensor names and, for a window llama.cpp drops, tokenizer, before anything is
    written), and the refusal to give once the safetensors export is written: what was asked
    beside the GGUF is still delivered."""
    if model_dir is None:
        return request, None
    try:
        if image_text.is_image_text(model_dir):  # the language model's GGUF and the vision tower's mmproj
            image_text.check_writable(model_dir)
        else:
            gguf_check.check_window(model_dir, target=gguf_export.check_writable(model_dir))
    except gguf_arch.GgufUnsupported as err:
        return replace(request, formats=("safetensors",), gguf_type=None, k_quant=None), err
    return request, None


def _refuse_gguf(refusal: UserError | None, out_dir: Path) -> None:
    if refusal is not None:
        raise gguf_arch.GgufUnsupported(f"{refusal}; the safetensors export is in {out_dir}: convert it with "
                                        "llama.cpp's convert_hf_to_gguf.py")


def _open_run(run_dir: Path, request: _Request, *, trust_remote_code: bool) -> tuple[RunInfo, Recipe]:
    """The run's rung and recipe, refusing what this export cannot do with them."""
    layout = RunDir(run_dir)
    info = layout.read_info()
    if request.adapter_only and not info.rung.adapters_enabled:
        raise UserError(f"{run_dir} is a {info.rung.method} run: it has no adapter; export it without --adapter-only")
    recipe = layout.read_recipe()
    if recipe.model.trust_remote_code and not trust_remote_code:
        raise UserError(
            f"{layout.recipe_file} sets model.trust_remote_code=true; export runs the model's own Python code "
            "only when you pass --trust-remote-code (check the model folder first)"
        )
    return info, recipe


def _identity(ckpt: Path, request: _Request) -> dict:
    """What makes two exports the same: running export again with an equal identity does nothing."""
    # The checkpoint's trainer_state.json is rewritten by every save, so a retrained run that
    # reuses the same step directory is a new identity.
    written_ns = (ckpt / checkpoint.STATE_FILE).stat().st_mtime_ns
    return {"checkpoint": str(ckpt.resolve()), "written_ns": written_ns, "adapter_only": request.adapter_only,
            "dtype": request.dtype, "formats": list(request.formats), "gguf_type": request.k_quant or request.gguf_type}


def _write_export(tmp: Path, *, source: _Source, request: _Request, model_dir: Path, name: str, hint: str | None,
                  eval_rows: Callable[[], list[dict] | None] | None) -> tuple[dict, gguf_quality.GgufQuality | None]:
    """Everything the export holds, written into `tmp`; returns its record (META, less the source)
    and, for a quantized GGUF, what it costs. `name` is the final folder name, for the files that
    tell how to run it."""
    # A GGUF-only export still goes through the merged safetensors (the GGUF is streamed from
    # them); they are written into a scratch folder inside the temporary one and dropped.
    hf_dir = tmp if request.safetensors else tmp / ".merged"
    recipe = source.recipe
    diff = _write_weights(hf_dir, source=source, request=request, model_dir=model_dir, name=name)
    record = {"method": source.rung.method, "max_abs_diff": diff}
    quality = system = None
    needs: list[str] = []
    mmproj = None
    if request.gguf_type:
        text_dir = image_text.text_model(hf_dir, tmp / ".text-model")  # hf_dir, or an image-text model's language model
        _, check = _write_gguf(text_dir, tmp, file_name=request.gguf_name, gguf_type=request.gguf_type, name=name,
                               system_prompt=recipe.data.system_prompt, k_quant=request.k_quant,
                               modelfile=text_dir == hf_dir)
        record["gguf"] = {"file": request.gguf_name, "type": request.gguf_type, "max_abs_diff": check.max_abs_diff,
                          "bound": check.bound}
        if text_dir != hf_dir:
            mmproj = image_text.write_mmproj(hf_dir, tmp, gguf_type=request.gguf_type, name=name, base_dir=model_dir,
                                             pixels=(recipe.data.image_min_pixels, recipe.data.image_max_pixels))
            record["gguf"]["mmproj"] = mmproj.as_dict()
        quality = _measure_quality(tmp / request.gguf_name, text_dir, gguf_type=request.gguf_type, rows=eval_rows)
        if quality:
            record["gguf"]["quality"] = quality.as_dict()
        system = local_runtimes.trained_system_turn(text_dir, system_prompt=recipe.data.system_prompt)
        needs = gguf_arch.runtime_needs(text_dir)
        for need in needs:
            log.warning("%s (RUNNING.md says so too)", need)
        for scratch in {text_dir, hf_dir} - {tmp}:
            shutil.rmtree(scratch)
    if request.adapter_gguf:
        record["gguf"] = {"file": request.adapter_gguf, "type": "lora-adapter", "max_rel_diff": _write_adapter_gguf(
            source.ckpt, model_dir, recipe, tmp / request.adapter_gguf, name=name)}
        (tmp / "RUNNING.md").write_text(local_runtimes.adapter_running_notes(
            name, base=recipe.model.path, image_text=image_text.is_image_text(model_dir)))
    if not request.adapter_only:
        _write_runtime_notes(tmp, name=name, safetensors=request.safetensors, gguf_name=request.gguf_name,
                             k_quant_hint=hint, system=system, needs=needs, mmproj=mmproj,
                             images=source.rung.images)
    return record, quality


def _measure_quality(gguf_path: Path, hf_dir: Path, *, gguf_type: str,
                     rows: Callable[[], list[dict] | None] | None) -> gguf_quality.GgufQuality | None:
    """gguf_quality's report, or None with one line said when it cannot be measured here: the GGUF
    has already passed verify_gguf (every tensor bit for bit, logits within its bound), so a report
    that fails never discards that export."""
    try:
        return gguf_quality.measure(gguf_path, hf_dir, gguf_type=gguf_type, rows=rows)
    except Exception as err:  # noqa: BLE001 - any failure of the extra report; the file itself is checked
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        log.warning("the %s GGUF's quality report could not be measured (%s: %s); the file passed its read-back "
                    "check and is kept", gguf_type, type(err).__name__, first)
        return None


def _write_weights(out: Path, *, source: _Source, request: _Request, model_dir: Path, name: str) -> float | None:
    """The weights, by what the rung trained: the adapter alone or merged into its base, or every
    weight gathered from the sharded checkpoint. A quantized (QLoRA) run's adapter merges into
    the full-precision base like a LoRA one (module docstring: never into the 4-bit weights)."""
    rung, ckpt, recipe = source.rung, source.ckpt, source.recipe
    if rung.adapters_enabled and request.adapter_only:
        return merged.write_adapter(ckpt, model_dir, recipe, out, images=rung.images) if request.safetensors else None
    if rung.adapters_enabled:
        if rung.quantized_enabled:
            log.info("export: the run trained on a %d-bit base; its adapter is merged into the full-precision base",
                     rung.quant_bits)
        return merged.write_merged(ckpt, model_dir, recipe, out, dtype=request.dtype, name=name, images=rung.images)
    from homelab_ft.export.consolidate import consolidate_to_hf

    return consolidate_to_hf(ckpt, model_dir, out, dtype=merged.saved_dtype(request.dtype, model_dir), images=rung.images)


def _write_gguf(hf_dir: Path, out: Path, *, file_name: str, gguf_type: str, name: str, system_prompt: str | None,
                k_quant: str | None, modelfile: bool = True):
    """The GGUF beside the export, checked against the merged model, plus an Ollama Modelfile (for
    a k-quant, naming the file llama-quantize will write from this one) unless `modelfile` is off
    (an image-text model's pair, which Ollama does not load: local_runtimes.OLLAMA_SPLIT_VISION)."""
    path = out / file_name
    gguf_export.write_gguf(hf_dir, path, gguf_type=gguf_type, name=name)
    check = gguf_check.verify_gguf(path, hf_dir, gguf_type=gguf_type)
    log.info("GGUF check (%s): %s", gguf_type, check.describe())
    loads, run_first = file_name, None
    if k_quant:
        loads = gguf_export.gguf_file_name(k_quant)
        run_first = gguf_export.quantize_command(Path(file_name), k_quant)
    if modelfile:
        (out / "Modelfile").write_text(local_runtimes.modelfile(hf_dir, file_name=loads, system_prompt=system_prompt,
                                                                run_first=run_first))
    return path, check


def _write_adapter_gguf(ckpt: Path, model_dir: Path, recipe, path: Path, *, name: str) -> float:
    """llama.cpp's LoRA GGUF, checked against PEFT's own delta for every adapted weight."""
    from homelab_ft.export import expert_adapters
    from homelab_ft.export.gguf.adapter import check_adapter_gguf, write_adapter_gguf

    beyond = expert_adapters.outside_peft(ckpt / checkpoint.ADAPTER)
    if beyond:
        raise UserError(f"export: an adapter GGUF cannot hold {beyond} yet; "
                        "export the merged model (gguf of the merged weights) instead")
    peft_model = merged.load_base_with_adapter(ckpt, model_dir, recipe)  # refuses an adapter that does not fit the base
    write_adapter_gguf(ckpt / checkpoint.ADAPTER, model_dir, path, name=name)
    diff = check_adapter_gguf(path, peft_model, model_dir)
    log.info("adapter GGUF check: alpha / r * B @ A vs PEFT's delta, max relative difference %.1e", diff)
    return diff


def _write_runtime_notes(out: Path, *, name: str, safetensors: bool, gguf_name: str | None, k_quant_hint: str | None,
                         system: local_runtimes.SystemTurn | None = None, needs: Sequence[str] = (),
                         mmproj: image_text.WrittenMmproj | None = None, images: bool = False) -> None:
    """How to run the model; `name` is the final folder name (`out` is still the temporary one);
    `images`: an image run's model, loaded with its processor and asked about an image."""
    text = "# Running this model\n\n"
    if gguf_name and mmproj:
        text += local_runtimes.image_text_running_notes(name, gguf_name=gguf_name, mmproj_name=mmproj.file,
                                                        k_quant_hint=k_quant_hint, system=system,
                                                        image_tokens=mmproj.image_tokens)
    elif gguf_name:
        text += local_runtimes.running_notes(name, gguf_name=gguf_name, k_quant_hint=k_quant_hint, system=system,
                                             needs=needs)
    if safetensors and images:
        text += (
            "transformers:\n\n"
            "    from transformers import AutoModelForImageTextToText, AutoProcessor\n"
            f"    model = AutoModelForImageTextToText.from_pretrained('{name}')\n"
            f"    processor = AutoProcessor.from_pretrained('{name}')\n\n"
            "homelab-ft:\n\n"
            f"    homelab-ft generate {name} --image photo.png --prompt 'What is in this image?'\n"
        )
    elif safetensors:
        text += (
            "transformers:\n\n"
            "    from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"    model = AutoModelForCausalLM.from_pretrained('{name}')\n\n"
            "homelab-ft:\n\n"
            f"    homelab-ft generate {name} --prompt 'Hello'\n"
        )
        if not gguf_name:
            text += (f"\nGGUF for llama.cpp, Ollama and LM Studio:\n\n"
                     f"    homelab-ft export RUN_DIR --out {name}-gguf --format gguf --gguf-type q8_0\n")
    (out / "RUNNING.md").write_text(text)
