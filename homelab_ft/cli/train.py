"""`homelab-ft train` and `demo`, and the one planning step `train` and `launch` share.

The machine where the user types the command plans once (`planned`), checks every input once, and
hands the result to every torchrun worker (`cluster.handoff`): on this machine through torchrun's
environment, on several through each node's command line (cli/cluster.py). A worker that received
it trains that rung with those inputs and plans nothing.
"""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path

from homelab_ft.cli import args as common
from homelab_ft.errors import UserError

log = logging.getLogger(__name__)


def add_train(sub) -> None:
    p = sub.add_parser("train", help="train a recipe")
    p.add_argument("recipe", type=Path)
    common.overrides(p)
    common.run_dir(p)
    resume = p.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint (refused when there is none)")
    resume.add_argument("--resume-or-start", action="store_true",
                        help="continue from the newest complete checkpoint, or start a new run when there is none")
    p.add_argument("--overwrite", action="store_true", help="replace a run directory that holds another run")
    p.add_argument("--allow-data-change", action="store_true",
                   help="with --resume: continue although the data differs from what the checkpoint was trained on")
    common.cluster_file(p)
    p.set_defaults(func=cmd_train)


def planned(recipe, *, cluster_file: str | None, base_dir: Path):
    """(plan, rung), decided once for `train` and `launch`: the planner's chosen option carries its
    rung; a named method the planner expects not to fit is tried anyway with the recipe's own rung
    (`rung_for`, which validates it). A refused combination stops here, with its fix; with `auto`
    and nothing fitting, the plan goes to stderr to say what would. GRPO's reward functions are
    resolved first (`preflight.check_rewards`; `base_dir` is the recipe's folder)."""
    from homelab_ft.cli.plan import measured_rows
    from homelab_ft.plan import planner, report
    from homelab_ft.rung import pipelined
    from homelab_ft.train import preflight

    preflight.check_rewards(recipe, base_dir=base_dir)
    plan = planner.plan_for_recipe(recipe, cluster_file=cluster_file, **measured_rows(recipe, base_dir=base_dir))
    if plan.chosen is not None:  # a pipeline the recipe names explicitly is run as named
        return plan, pipelined(plan.chosen.rung, recipe.sharding)
    if recipe.method == "auto":
        print(report.format_plan(plan), file=sys.stderr)
        raise UserError("no rung of the ladder fits this model on this hardware; see the plan above for what would")
    rung = planner.named_rung(recipe, plan)  # a refused combination stops here, before the warning
    log.warning("the planner expects method %s not to fit (run `homelab-ft plan` for the numbers); trying anyway",
                recipe.method)
    return plan, rung


def checked_handoff(recipe, *, plan, rung):
    """Check every input here (preflight.check_inputs) and wrap the result with the plan and rung
    for the workers; returns (Handoff, Inputs)."""
    from homelab_ft.cluster.handoff import Handoff
    from homelab_ft.distributed import comm
    from homelab_ft.train import preflight

    inputs = preflight.check_inputs(recipe, rung=rung, facts=plan.shape.facts,
                                    device_type=comm.device_type(recipe.train.device))
    handoff = Handoff(rung=rung, plan=plan.to_dict(), facts=inputs.facts, model_dir=str(inputs.model_dir),
                      resume_from=str(inputs.resume_from) if inputs.resume_from else None)
    return handoff, inputs


def _train_overrides(args) -> list[str]:
    """The recipe's overrides with the flags that stand for some; torchrun's workers get them as
    plain overrides (the --cluster file's values too: they need not read the file)."""
    overrides = common.with_run_dir(args, common.with_cluster_file(args, list(args.overrides)))
    if args.resume:
        overrides.append("train.resume=true")
    if args.resume_or_start:
        overrides.append("train.resume=auto")
    if args.overwrite:
        overrides.append("output.overwrite=true")
    if args.allow_data_change:
        overrides.append("train.allow_data_change=true")
    return overrides


_SAID_AS_FLAGS = ("train.resume=", "output.overwrite=", "output.dir=", "train.allow_data_change=")
"""Overrides `_train_overrides` makes of flags (a torchrun worker receives them so): the resume
command says --resume and --run-dir instead, and never --overwrite or --allow-data-change (one resume's consent)."""


def resume_command(args, *, run_dir: Path, nodes: int = 1) -> str:
    """The command a stopped run prints to continue: this recipe with the overrides it ran with
    (and its --cluster file), --resume and the run directory, quoted for a POSIX shell. A job of
    several nodes continues through `launch`, which takes the same as overrides; its hostfile is
    known only where `launch` ran, so that one word stays a placeholder."""
    kept = [o for o in args.overrides if not o.startswith(_SAID_AS_FLAGS)]
    if nodes > 1:
        return shlex.join(["homelab-ft", "launch", "--hosts", "HOSTFILE", str(args.recipe), *kept,
                           "train.resume=true", "--run-dir", str(run_dir)])
    cluster = ["--cluster", str(args.cluster)] if args.cluster else []
    return shlex.join(["homelab-ft", "train", str(args.recipe), *kept, *cluster, "--resume", "--run-dir", str(run_dir)])


def cmd_train(args) -> int:
    """Plan, check every input, then train here or under torchrun; nothing is created before the
    checks pass, and torchrun's workers reuse this process's plan instead of planning again."""
    from homelab_ft.cluster import handoff as handoffs
    from homelab_ft.cluster import launch
    from homelab_ft.recipe.config import load_recipe
    from homelab_ft.train import preflight, trainer

    overrides = _train_overrides(args)
    recipe = load_recipe(args.recipe, overrides)
    base_dir = args.recipe.resolve().parent
    received = handoffs.received()
    if recipe.eval.tasks and received is None and not handoffs.under_torchrun():
        from homelab_ft.harness import run as harness

        harness.check_tasks(list(recipe.eval.tasks))  # an unknown task stops the run before it starts
    again = resume_command(args, run_dir=recipe.run_dir, nodes=received.rung.nodes if received else 1)
    if received is not None:
        log.info("received the launching machine's rung (%s) and checked inputs; not planning, probing the "
                 "hardware or checking again", received.rung.label)
        trainer.train(recipe, plan=received.plan, rung=received.rung,
                      inputs=preflight.inputs_in_worker(recipe, received), base_dir=base_dir, resume_command=again)
        return 0
    plan, rung = planned(recipe, cluster_file=common.cluster_file_name(args), base_dir=base_dir)
    if handoffs.under_torchrun():
        # torchrun started by hand, without a handoff: every rank checks its own inputs.
        trainer.train(recipe, plan=plan.to_dict(), rung=rung, base_dir=base_dir, resume_command=again)
        return 0
    handoff, inputs = checked_handoff(recipe, plan=plan, rung=rung)
    _check_this_machine(recipe, plan=plan, rung=rung)
    if rung.process_group_enabled:
        # Rows are checked (and the tokenised cache filled) here, so a bad row stops the run before
        # any worker starts.
        preflight.check_data(recipe, inputs, base_dir=base_dir)
        code = launch.run_workers(recipe, str(args.recipe), overrides + common.verbosity_flags(args), handoff=handoff)
    else:
        trainer.train(recipe, plan=handoff.plan, rung=rung, inputs=inputs, base_dir=base_dir, resume_command=again)
        code = 0
    if code == 0:
        from homelab_ft.cli.evaluate import after_training

        after_training(recipe)  # the recipe's eval.tasks on the finished run
    return code


def _check_this_machine(recipe, *, plan, rung) -> None:
    """What only the machine that runs every rank can check: host RAM for offloaded activations and
    a host-side embedding table (refused when short), and disk space for the checkpoints (a warning)."""
    from homelab_ft.distributed import comm
    from homelab_ft.host import available_ram_bytes
    from homelab_ft.plan.price.activations import activation_offload_host_bytes
    from homelab_ft.plan.price.params import host_embedding_bytes
    from homelab_ft.train import preflight

    ranks, priced = plan.cluster.gpus_per_node, dict(rung=rung, request=plan.request, cluster=plan.cluster)
    offloaded = ranks * activation_offload_host_bytes(plan.shape, **priced) if rung.activation_offload else 0
    table = ranks * host_embedding_bytes(plan.shape, **priced)
    if offloaded or table:
        preflight.check_host_ram(device_type=comm.device_type(recipe.train.device), available_bytes=available_ram_bytes(),
                                 offloaded_bytes=offloaded, table_bytes=table)
    if plan.checkpoint_bytes:
        from homelab_ft.plan.price.diskspace import space_warning
        from homelab_ft.store.layout import RunDir

        note = space_warning(RunDir(recipe.run_dir).checkpoints, checkpoint_bytes=plan.checkpoint_bytes, keep_last=recipe.train.keep_last)
        if note:
            print(f"warning: {note}", file=sys.stderr)


def add_demo(sub) -> None:
    p = sub.add_parser("demo", help="fine-tune on a demo task, export, and compare the held-out score before/after")
    p.add_argument("--task", choices=("json", "shapes"), default="json",
                   help="json: sentences to JSON records (SmolLM2, LoRA); shapes: questions about generated "
                        "pictures (a tiny SmolVLM, full fine-tune)")
    p.add_argument("--run-dir", type=Path, help="default: runs/demo (json), runs/smolvlm-shapes-cpu (shapes)")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    from homelab_ft.demo.run import run_demo, run_shapes_demo

    if args.task == "shapes":
        run_shapes_demo(run_dir=args.run_dir or Path("runs/smolvlm-shapes-cpu"))
    else:
        run_demo(run_dir=args.run_dir or Path("runs/demo"))
    return 0
