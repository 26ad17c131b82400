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
    _offline_and_quiet_libraries()
    code = _run(argv)
    from homelab_ft.cluster.launch import under_torchrun

    if under_torchrun():
        # FSDP2 processes on CPU can abort at interpreter exit after the process group is
        # destroyed (see comm.teardown); leave with the real exit code instead.
        from homelab_ft.distributed.comm import exit_now

        exit_now(code)
    return code


def _offline_and_quiet_libraries() -> None:
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
    from homelab_ft import logs

    logs.configure(args.verbose - args.quiet)
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
    parser = argparse.ArgumentParser(prog="homelab-ft", description="Fine-tune open-weight LLMs on your own hardware.",
                                     parents=[_verbosity()])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Every subcommand takes -q/-v too, after its own arguments (`homelab-ft train r.yaml -q`).
    original = sub.add_parser
    sub.add_parser = lambda *a, **kw: original(*a, parents=[_verbosity(default=argparse.SUPPRESS)], **kw)
    _add_plan(sub)
    _add_train(sub)
    _add_export(sub)
    _add_generate(sub)
    _add_demo(sub)
    _add_recipes(sub)
    _add_data(sub)
    _add_launch(sub)
    _add_doctor(sub)
    return parser


def _verbosity(default=0) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="count", default=default, help="only warnings and errors")
    common.add_argument("-v", "--verbose", action="count", default=default, help="more detail (debug messages)")
    return common


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
    _cluster_file(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_plan)


def _cluster_file(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", type=Path, metavar="FILE",
                   help="cluster file written by `homelab-ft doctor`: its measured values replace the recipe's "
                        "cluster section (flags such as --gpus/--link still win)")


def _with_cluster_file(args, overrides: list[str]) -> list[str]:
    """The recipe's overrides, then the --cluster file's values (which a flag after them may replace)."""
    if args.cluster is None:
        return overrides
    from homelab_ft.cluster import clusterfile

    return [*overrides, *clusterfile.overrides(args.cluster)]


def _cmd_plan(args) -> int:
    """Exit 0 when an option fits, 2 when nothing does (the table says what would)."""
    from homelab_ft.config import load_recipe
    from homelab_ft.plan.hardware import cluster_overrides
    from homelab_ft.plan.planner import format_plan, plan_for_recipe

    flags = cluster_overrides(gpus=args.gpus, nodes=args.nodes, link=args.link, host_ram=args.host_ram)
    result = plan_for_recipe(load_recipe(args.recipe, _with_cluster_file(args, list(args.overrides)) + flags),
                             cluster_file=args.cluster.name if args.cluster else None)
    print(result.to_json() if args.json else format_plan(result))
    return 0 if result.fits else 2


# ---------------------------------------------------------------------------------------------- train


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a recipe")
    p.add_argument("recipe", type=Path)
    _overrides(p)
    p.add_argument("--run-dir", help="run directory (default: runs/<recipe name>)")
    resume = p.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint (refused when there is none)")
    resume.add_argument("--resume-or-start", action="store_true",
                        help="continue from the newest complete checkpoint, or start a new run when there is none")
    p.add_argument("--overwrite", action="store_true", help="replace a run directory that holds another run")
    _cluster_file(p)
    p.set_defaults(func=_cmd_train)


def _cmd_train(args) -> int:
    """Plan, check every input, then train here or under torchrun; nothing is created before the
    checks pass, and torchrun's workers reuse this process's plan instead of planning again."""
    from homelab_ft.cluster import launch
    from homelab_ft.config import load_recipe
    from homelab_ft.plan import planner
    from homelab_ft.rung import rung_for

    # torchrun's workers get the file's values as plain overrides: they need not read the file
    overrides = _with_cluster_file(args, list(args.overrides))
    if args.run_dir:
        overrides.append(f"output.dir={args.run_dir}")
    if args.resume:
        overrides.append("train.resume=true")
    if args.resume_or_start:
        overrides.append("train.resume=auto")
    if args.overwrite:
        overrides.append("output.overwrite=true")
    recipe = load_recipe(args.recipe, overrides)
    base_dir = args.recipe.resolve().parent

    from homelab_ft.distributed import comm
    from homelab_ft.train import preflight, trainer

    handoff = launch.received_handoff()
    if handoff is not None:
        trainer.train(recipe, plan=handoff.plan, rung=handoff.rung, inputs=preflight.inputs_in_worker(recipe, handoff),
                      base_dir=base_dir)
        return 0
    # a refused combination stops here, with its fix
    plan = planner.plan_for_recipe(recipe, cluster_file=args.cluster.name if args.cluster else None)
    if plan.chosen is None and recipe.method == "auto":
        print(planner.format_plan(plan), file=sys.stderr)
        raise UserError("no rung of the ladder fits this model on this hardware; see the plan above for what would")
    rung = rung_for(recipe, plan.chosen)
    if launch.under_torchrun():
        # Started by `homelab-ft launch` (which pins the rung in the arguments) or by hand: every
        # rank checks its own inputs.
        trainer.train(recipe, plan=plan, rung=rung, base_dir=base_dir)
        return 0
    if plan.chosen is None:
        print(f"warning: the planner expects method {recipe.method} not to fit (run `homelab-ft plan` for the "
              "numbers); trying anyway", file=sys.stderr)
    device_type = comm.device_type(recipe.train.device)
    inputs = preflight.check_inputs(recipe, rung=rung, device_type=device_type)
    if rung.activation_offload:
        from homelab_ft.plan.hardware import available_ram_bytes
        from homelab_ft.plan.memory import activation_offload_host_bytes

        preflight.check_activation_offload(
            rung, device_type=device_type, available_bytes=available_ram_bytes(),
            offloaded_bytes=plan.cluster.gpus_per_node * activation_offload_host_bytes(
                plan.shape, rung=rung, request=plan.request, cluster=plan.cluster))
    if plan.checkpoint_bytes:
        from homelab_ft.plan.diskspace import space_warning

        note = space_warning(recipe.run_dir, checkpoint_bytes=plan.checkpoint_bytes, keep_last=recipe.train.keep_last)
        if note:
            print(f"warning: {note}", file=sys.stderr)
    if rung.process_group_enabled:
        # Rows are checked (and the tokenised cache filled) here, so a bad row stops the run before
        # any worker starts.
        preflight.check_data(recipe, inputs, base_dir=base_dir)
        flags = ["--quiet"] * args.quiet + ["--verbose"] * args.verbose
        return launch.run_workers(recipe, str(args.recipe), overrides + flags,
                                  handoff=launch.Handoff(rung=rung, plan=plan.to_dict(), model_dir=str(inputs.model_dir),
                                                         resume_from=str(inputs.resume_from) if inputs.resume_from else None))
    trainer.train(recipe, plan=plan, rung=rung, inputs=inputs, base_dir=base_dir)
    return 0


# --------------------------------------------------------------------------------------------- launch


def _add_launch(sub) -> None:
    from homelab_ft.cluster.launch import DEFAULT_PORT

    p = sub.add_parser("launch", help="print (or run over ssh) each node's torchrun command for a multi-node recipe")
    p.add_argument("recipe")
    _overrides(p)
    p.add_argument("--hosts", type=Path, required=True, help="hostfile: one host per line, the head node first")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="rendezvous TCP port on the head node")
    p.add_argument("--iface", help="network interface to use (sets NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME)")
    p.add_argument("--workdir", help="directory of this checkout on every node (default: the current one)")
    p.add_argument("--join-timeout", type=int, default=300, help="seconds to wait for all nodes to join")
    p.add_argument("--run", action="store_true", help="start the commands over ssh instead of printing them")
    _cluster_file(p)
    p.set_defaults(func=_cmd_launch)


def _cmd_launch(args) -> int:
    from homelab_ft.cluster.launch import launch_commands, run_over_ssh

    # the file's values are pinned on every node's command line: the other nodes need not have it
    commands = launch_commands(args.hosts, args.recipe, _with_cluster_file(args, list(args.overrides)),
                               port=args.port, iface=args.iface,
                               workdir=args.workdir, join_timeout_s=args.join_timeout)
    if args.run:
        return run_over_ssh(commands)
    for command in commands:
        print(f"# on {command.host.address}:")
        print(command.shell_line())
    return 0


# --------------------------------------------------------------------------------------------- doctor


def _add_doctor(sub) -> None:
    from homelab_ft.cluster.launch import DEFAULT_PORT

    p = sub.add_parser("doctor", help="check this machine or a cluster through the launcher a run uses; measure its links")
    p.add_argument("recipe", nargs="?", help="also check disk and host RAM against what `plan` needs for this recipe")
    _overrides(p)
    p.add_argument("--hosts", help="hostfile: one host per line, the head node first (default: this machine alone)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="rendezvous TCP port on the head node (with --hosts)")
    p.add_argument("--iface", help="network interface to use (sets NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME)")
    p.add_argument("--nproc-per-node", type=int,
                   help="processes per node (default: the recipe's, else one per GPU, else 2 on one CPU machine, 1 per node)")
    p.add_argument("--workdir", help="directory of this checkout on every node (default: the current one)")
    p.add_argument("--join-timeout", type=int, default=300, help="seconds to wait for all nodes to join")
    p.add_argument("--run", action="store_true", help="start the commands over ssh instead of printing them")
    p.add_argument("--run-dir", help="directory to check for free space and sharing (default: the recipe's, else runs)")
    p.add_argument("--out", help="write the measured cluster to this YAML file (for --cluster)")
    p.set_defaults(func=_cmd_doctor)


def _cmd_doctor(args) -> int:
    """Exit 0 when every line is ok or warn, 2 when one FAILs (or a check before launch fails)."""
    from homelab_ft.cluster import doctor, launch

    if launch.under_torchrun():
        from homelab_ft.cluster.doctor_rank import run_rank

        outcome = run_rank(recipe_path=args.recipe, overrides=list(args.overrides), iface=args.iface,
                                  run_dir=args.run_dir, out=args.out, join_timeout_s=args.join_timeout)
        if outcome.table is not None:
            print(outcome.table)
            if outcome.error:
                raise UserError(outcome.error)
            if outcome.written:
                print(f"\nwrote {outcome.written}: pass it to plan and train with --cluster {outcome.written}")
        return outcome.code
    worker_args = [f"--join-timeout={args.join_timeout}", *["--quiet"] * args.quiet, *["--verbose"] * args.verbose]
    for flag, value in (("--iface", args.iface), ("--run-dir", args.run_dir), ("--out", args.out)):
        if value:
            worker_args.append(f"{flag}={value}")
    started = doctor.prepare(recipe_path=args.recipe, overrides=list(args.overrides), hostfile=args.hosts,
                             iface=args.iface, port=args.port, nproc_per_node=args.nproc_per_node, run=args.run,
                             worker_args=worker_args, join_timeout_s=args.join_timeout, workdir=args.workdir)
    if started.argv:
        return launch.run_supervised(started.argv, env=started.env)
    if args.run:
        return launch.run_over_ssh(started.commands)
    for command in started.commands:
        print(f"# on {command.host.address}:")
        print(command.shell_line())
    return 0


# --------------------------------------------------------------------------------------------- export


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="merge a run's adapter into its base and write safetensors")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, required=True, help="output model directory")
    p.add_argument("--adapter-only", action="store_true", help="write the adapter alone (PEFT format)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype of the written weights (auto: the base model's)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--format", default="safetensors", metavar="safetensors|gguf|safetensors,gguf",
                   help="what to write: merged safetensors (default), a GGUF file for llama.cpp / Ollama / LM Studio, or both")
    p.add_argument("--gguf-type", metavar="f32|f16|bf16|q8_0|q4_0|q5_1",
                   help="GGUF weight type (default q8_0); a k-quant such as q4_k_m writes f16 and prints the llama-quantize command")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the model's own Python code when the run's recipe asks for it")
    p.set_defaults(func=_cmd_export)


def _cmd_export(args) -> int:
    from homelab_ft.export.run import export_run

    result = export_run(args.run_dir, args.out, adapter_only=args.adapter_only, dtype=args.dtype, overwrite=args.overwrite,
                        formats=args.format, gguf_type=args.gguf_type, trust_remote_code=args.trust_remote_code,
                        eval_rows=lambda: _export_eval_rows(args.run_dir))
    if not result.skipped:
        print(f"exported to {result.out_dir}")
    if result.quality:
        print(result.quality.line())
    if result.quantize_hint:
        print(f"k-quants need llama.cpp's llama-quantize; wrote f16, now run: {result.quantize_hint}")
    return 0


def _export_eval_rows(run_dir: Path) -> list[dict] | None:
    """The run's eval rows, tokenized as it trained, for the quality report of a quantized GGUF;
    None (the report then uses a few held-out prompts) when the run has none or its data cannot be
    read here (a run directory copied without its data files)."""
    from homelab_ft.config import load_recipe
    from homelab_ft.data.sft import prepare_for
    from homelab_ft.model import loading

    try:
        recipe = load_recipe(Path(run_dir) / "recipe.yaml")
        model_dir = loading.resolve_model_dir(recipe.model.path)
        prepared = prepare_for(recipe, loading.load_tokenizer(recipe.model, model_dir))
    except (UserError, OSError, ValueError, KeyError) as err:
        logging.getLogger(__name__).warning("the run's eval rows cannot be read here (%s); a quantized GGUF is "
                                            "measured on held-out prompts instead", str(err).splitlines()[0][:160])
        return None
    return list(prepared.eval) if prepared.eval is not None else None


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
    from homelab_ft.cli.generate import chat

    print(chat(args.model, args.prompt, system=args.system, max_new_tokens=args.max_new_tokens, temperature=args.temperature))
    return 0


# ----------------------------------------------------------------------------------------------- demo


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="fine-tune the embedded SmolLM2 on the shipped task and compare before/after")
    p.add_argument("--run-dir", type=Path, default=Path("runs/demo"))
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args) -> int:
    from homelab_ft.demo.sft import run_demo

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
    from homelab_ft.cli.data_inspect import inspect_recipe
    from homelab_ft.config import load_recipe

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
