"""`homelab-ft` subcommands. Thin: parse, call one function, print.

A `UserError` anywhere below becomes one line on stderr and exit code 2; anything else is our bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path

from homelab_ft.errors import UserError


def main(argv: list[str] | None = None) -> int:
    _quiet_and_offline()
    code = _run(argv)
    from homelab_ft.launch import under_torchrun

    if under_torchrun():
        # FSDP2 processes on CPU can abort at interpreter exit after the process group is
        # destroyed (see distributed.teardown); leave with the real exit code instead.
        from homelab_ft.distributed import exit_now

        exit_now(code)
    return code


def _quiet_and_offline() -> None:
    """homelab-ft never downloads: the Hugging Face libraries are told so before they load.

    Two messages every run would print are silenced: bitsandbytes' note that an optional CPU
    kernel package is missing (it serves the AVX512-BF16 path that quant.after_load turns off),
    and a FutureWarning that peft 0.21 triggers by calling a renamed transformers 5 method.
    """
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(var, "1")
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    # Overrides may come after options (`train r.yaml --resume train.lr=1e-4`), which argparse's
    # positional handling alone does not allow.
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if "=" not in a or a.startswith("-")]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        return args.func(args) or 0
    except UserError as err:
        if str(err):  # empty on the ranks that leave the telling to rank 0
            print(f"homelab-ft: {err.label}: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("homelab-ft: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="homelab-ft", description="Fine-tune open-weight LLMs on your own hardware.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_plan(sub)
    _add_train(sub)
    _add_export(sub)
    _add_generate(sub)
    _add_demo(sub)
    _add_recipes(sub)
    _add_data(sub)
    _add_launch(sub)
    return parser


def _overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="recipe overrides, e.g. train.lr=1e-4")


# ----------------------------------------------------------------------------------------------- plan


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="predict memory per device and pick QLoRA / LoRA / full sharding (no torch)")
    p.add_argument("recipe", type=Path)
    _overrides(p)
    p.add_argument("--gpus", help="GPUs per node and memory each, e.g. 2x24GB (default: recipe, else detected)")
    p.add_argument("--nodes", type=int, help="number of machines")
    p.add_argument("--link", help="Ethernet speed between nodes, e.g. 1Gbit, 2.5Gbit, 10GbE")
    p.add_argument("--host-ram", help="RAM per node, e.g. 64GB (default: recipe, else detected)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args) -> int:
    """Exit 0 when an option fits, 2 when nothing does (the table says what would)."""
    from homelab_ft.config import load_recipe
    from homelab_ft.hardware import cluster_overrides
    from homelab_ft.planner import format_plan, plan_for_recipe

    flags = cluster_overrides(gpus=args.gpus, nodes=args.nodes, link=args.link, host_ram=args.host_ram)
    result = plan_for_recipe(load_recipe(args.recipe, list(args.overrides) + flags))
    print(result.to_json() if args.json else format_plan(result))
    return 0 if result.fits else 2


# ---------------------------------------------------------------------------------------------- train


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a recipe")
    p.add_argument("recipe", type=Path)
    _overrides(p)
    p.add_argument("--run-dir", help="run directory (default: runs/<recipe name>)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace a run directory that holds another run")
    p.set_defaults(func=_cmd_train)


def _cmd_train(args) -> int:
    from homelab_ft.config import load_recipe

    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"output.dir={args.run_dir}")
    if args.resume:
        overrides.append("train.resume=true")
    if args.overwrite:
        overrides.append("output.overwrite=true")
    recipe = load_recipe(args.recipe, overrides)

    from homelab_ft import launch, modeling, planner

    if not launch.under_torchrun():
        # Convert a GGUF model (once) before any worker processes start, and fail on a bad path here.
        modeling.resolve_model_dir(recipe.model.path)
    plan = planner.plan_for_recipe(recipe)
    if plan.chosen is None and recipe.method == "auto":
        print(planner.format_plan(plan), file=sys.stderr)
        raise UserError("no rung of the ladder fits this model on this hardware; see the plan above for what would")
    if plan.chosen is None and not launch.under_torchrun():
        print(f"warning: the planner expects method {recipe.method} not to fit (run `homelab-ft plan` for the "
              "numbers); trying anyway", file=sys.stderr)

    if not launch.under_torchrun():
        from homelab_ft.rundir import check_before_launch

        check_before_launch(recipe)
    if plan.checkpoint_bytes and not launch.under_torchrun():
        from homelab_ft.diskspace import space_warning

        note = space_warning(recipe.run_dir, checkpoint_bytes=plan.checkpoint_bytes, keep_last=recipe.train.keep_last)
        if note:
            print(f"warning: {note}", file=sys.stderr)

    from homelab_ft import trainer

    rung = trainer.resolve_rung(recipe, plan)
    # FSDP needs a process group even on one GPU (sharding onto one rank to offload to the CPU).
    needs_group = rung.strategy != "no_shard"
    code = launch.reexec_under_torchrun(recipe, str(args.recipe), overrides, force=needs_group, plan=plan)
    if code is not None:
        return code
    trainer.train(recipe, plan=plan, base_dir=args.recipe.resolve().parent)
    return 0


# --------------------------------------------------------------------------------------------- launch


def _add_launch(sub) -> None:
    p = sub.add_parser("launch", help="print (or run over ssh) each node's torchrun command for a multi-node recipe")
    p.add_argument("recipe")
    _overrides(p)
    p.add_argument("--hosts", type=Path, required=True, help="hostfile: one host per line, the head node first")
    p.add_argument("--port", type=int, default=29500, help="rendezvous TCP port on the head node")
    p.add_argument("--iface", help="network interface to use (sets NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME)")
    p.add_argument("--workdir", help="directory of this checkout on every node (default: the current one)")
    p.add_argument("--join-timeout", type=int, default=300, help="seconds to wait for all nodes to join")
    p.add_argument("--run", action="store_true", help="start the commands over ssh instead of printing them")
    p.set_defaults(func=_cmd_launch)


def _cmd_launch(args) -> int:
    from homelab_ft.launch import launch

    return launch(args.hosts, args.recipe, list(args.overrides), port=args.port, iface=args.iface, run=args.run,
                  workdir=args.workdir, join_timeout_s=args.join_timeout)


# --------------------------------------------------------------------------------------------- export


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="merge a run's adapter into its base and write safetensors")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, required=True, help="output model directory")
    p.add_argument("--adapter-only", action="store_true", help="write the adapter alone (PEFT format)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype of the written weights (auto: the base model's)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the model's own Python code when the run's recipe asks for it")
    p.set_defaults(func=_cmd_export)


def _cmd_export(args) -> int:
    from homelab_ft.export import export_run

    result = export_run(args.run_dir, args.out, adapter_only=args.adapter_only, dtype=args.dtype, overwrite=args.overwrite,
                        trust_remote_code=args.trust_remote_code)
    if not result.skipped:
        print(f"exported to {result.out_dir}")
    return 0


# ------------------------------------------------------------------------------------------- generate


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="chat with a base or exported model (chat template applied)")
    p.add_argument("model", help="model directory, .gguf file, cached hub id, or smollm2")
    p.add_argument("--prompt", required=True)
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args) -> int:
    from homelab_ft.generate import chat

    print(chat(args.model, args.prompt, system=args.system, max_new_tokens=args.max_new_tokens, temperature=args.temperature))
    return 0


# ----------------------------------------------------------------------------------------------- demo


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="fine-tune the embedded SmolLM2 on the shipped task and compare before/after")
    p.add_argument("--run-dir", type=Path, default=Path("runs/demo"))
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args) -> int:
    from homelab_ft.demo import run_demo

    run_demo(run_dir=args.run_dir)
    return 0


# ----------------------------------------------------------------------------------------------- data


def _add_data(sub) -> None:
    p = sub.add_parser("data", help="look at a recipe's data before training")
    data_sub = p.add_subparsers(dest="data_command", required=True, metavar="DATA_COMMAND")
    q = data_sub.add_parser("inspect", help="rows, tokens, lengths, packing and one sample with its trained tokens")
    q.add_argument("recipe", type=Path)
    _overrides(q)
    q.add_argument("--no-color", action="store_true", help="mark trained tokens with [[ ]] instead of colour")
    q.set_defaults(func=_cmd_data_inspect)


def _cmd_data_inspect(args) -> int:
    from homelab_ft.config import load_recipe
    from homelab_ft.data_inspect import inspect_recipe

    recipe = load_recipe(args.recipe, list(args.overrides))
    color = sys.stdout.isatty() and not args.no_color
    print(inspect_recipe(recipe, base_dir=args.recipe.resolve().parent, color=color))
    return 0


# -------------------------------------------------------------------------------------------- recipes


def _add_recipes(sub) -> None:
    p = sub.add_parser("recipes", help="list the recipes in a folder")
    p.add_argument("folder", type=Path, nargs="?", default=Path("recipes"))
    p.set_defaults(func=_cmd_recipes)


def _cmd_recipes(args) -> int:
    from homelab_ft.config import load_recipe

    files = sorted(args.folder.glob("*.yaml"))
    if not files:
        raise UserError(f"no *.yaml recipes in {args.folder}")
    for path in files:
        recipe = load_recipe(path)
        print(f"{path.stem:32s} {recipe.method:6s} {recipe.model.path}  ({recipe.world_size} process(es))")
    return 0
