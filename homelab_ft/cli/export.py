"""The subcommands after training: `export` a run, `generate` with a model."""

from __future__ import annotations

import logging
from pathlib import Path

from homelab_ft.cli.args import sampling as sampling_flags
from homelab_ft.errors import UserError

log = logging.getLogger(__name__)


def add_export(sub) -> None:
    p = sub.add_parser("export", help="merge a run's adapter into its base and write safetensors")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, required=True, help="output model directory")
    p.add_argument("--adapter-only", action="store_true", help="write the adapter alone (PEFT format)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype of the written weights (auto: the base model's)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--format", default="safetensors", metavar="safetensors|gguf|safetensors,gguf",
                   help="what to write: merged safetensors (default), a GGUF file for llama.cpp / Ollama / LM Studio, or both")
    p.add_argument("--gguf-type", metavar="f32|f16|bf16|q8_0|q4_0|q5_1|mxfp4_moe",
                   help="GGUF weight type (default q8_0); a k-quant such as q4_k_m writes f16 and prints the llama-quantize command")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the model's own Python code when the run's recipe asks for it")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from homelab_ft.export.run import export_run

    result = export_run(args.run_dir, args.out, adapter_only=args.adapter_only, dtype=args.dtype, overwrite=args.overwrite,
                        formats=args.format, gguf_type=args.gguf_type, trust_remote_code=args.trust_remote_code,
                        eval_rows=lambda: eval_rows(args.run_dir))
    if not result.skipped:
        print(f"exported to {result.out_dir}")
    if result.quality:
        print(result.quality.line())
    if result.quantize_hint:
        print(f"k-quants need llama.cpp's llama-quantize; wrote f16, now run: {result.quantize_hint}")
    return 0


def eval_rows(run_dir: Path) -> list[dict] | None:
    """The run's eval rows, tokenized as it trained, for the quality report of a quantized GGUF;
    None (the report then uses a few held-out prompts) when the run has none or its data cannot be
    read here (a run directory copied without its data files)."""
    from homelab_ft.data import prepare_for
    from homelab_ft.model import loading
    from homelab_ft.recipe.config import load_recipe
    from homelab_ft.store.layout import RunDir

    try:
        recipe = load_recipe(RunDir(run_dir).recipe_file)
        model_dir = loading.resolve_model_dir(recipe.model.path)
        prepared = prepare_for(recipe, loading.load_tokenizer(recipe.model, model_dir))
    except (UserError, OSError, ValueError, KeyError) as err:
        log.warning("the run's eval rows cannot be read here (%s); a quantized GGUF is measured on held-out "
                    "prompts instead", str(err).splitlines()[0][:160])
        return None
    return list(prepared.eval) if prepared.eval is not None else None


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="chat with a base or exported model (chat template applied)")
    p.add_argument("model", help="model directory, .gguf file, cached hub id, or smollm2")
    sampling_flags(p, prompt_required=True)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from homelab_ft.cli.generate import Decoding, chat

    print(chat(args.model, args.prompt, system=args.system, decoding=Decoding.from_args(args),
               images=tuple(args.image)))
    return 0
