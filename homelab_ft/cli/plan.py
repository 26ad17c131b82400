"""The subcommands that look at a recipe before training: `plan`, `recipes`, `data inspect`."""

from __future__ import annotations

import sys
from pathlib import Path

from homelab_ft.cli import args as common
from homelab_ft.errors import UserError


def add_plan(sub) -> None:
    p = sub.add_parser("plan", help="predict memory per device and pick QLoRA / LoRA / full sharding (no torch)")
    p.add_argument("recipe", type=Path)
    common.overrides(p)
    p.add_argument("--gpus", help="GPUs per node and memory each, e.g. 2x24GB; one entry per node when they differ, "
                                         "e.g. 1x24GB,1x12GB (default: recipe, else detected)")
    p.add_argument("--nodes", type=int, help="number of machines")
    p.add_argument("--link", help="Ethernet speed between nodes, e.g. 1Gbit, 2.5Gbit, 10GbE")
    p.add_argument("--host-ram", help="RAM per node, e.g. 64GB (default: recipe, else detected)")
    common.cluster_file(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    """Exit 0 when an option fits, 2 when nothing does (the table says what would)."""
    from homelab_ft.plan.hardware import cluster_overrides
    from homelab_ft.plan.planner import plan_for_recipe
    from homelab_ft.plan.report import format_plan
    from homelab_ft.recipe.config import load_recipe

    flags = cluster_overrides(gpus=args.gpus, nodes=args.nodes, link=args.link, host_ram=args.host_ram)
    recipe = load_recipe(args.recipe, common.with_cluster_file(args, list(args.overrides)) + flags)
    result = plan_for_recipe(recipe, cluster_file=common.cluster_file_name(args),
                             **measured_rows(recipe, base_dir=args.recipe.resolve().parent))
    print(result.to_json() if args.json else format_plan(result))
    if not args.json and recipe.train.num_epochs is not None:  # the planner prices a step; it tokenises nothing
        print(f"train.num_epochs {recipe.train.num_epochs:g}: the steps are counted once the data is tokenised; "
              f"`homelab-ft data inspect {args.recipe}` says how many")
    return 0 if result.fits else 2


def measured_rows(recipe, *, base_dir: Path) -> dict:
    """The recipe's rows as the last preparation of its data here measured them (data/lengths.py),
    as plan_for_recipe's inputs: `lengths` (None when its data was not prepared here yet) and, for an
    image run, `image_counts` (images and image tokens per row; () before)."""
    from homelab_ft.data.lengths import stored, stored_images
    from homelab_ft.plan.inputs import RowLengths

    counts = stored(recipe, base_dir=base_dir)
    images = stored_images(recipe, base_dir=base_dir) if recipe.data.images else None
    return {"lengths": RowLengths(counts=counts) if counts else None, "image_counts": images or ()}


def add_recipes(sub) -> None:
    p = sub.add_parser("recipes", help="list the recipes in a folder")
    p.add_argument("folder", type=Path, nargs="?", default=Path("recipes"))
    p.set_defaults(func=cmd_recipes)


def cmd_recipes(args) -> int:
    from homelab_ft.recipe.config import load_recipe

    files = sorted(args.folder.glob("*.yaml"))
    if not files:
        raise UserError(f"no *.yaml recipes in {args.folder}")
    for path in files:
        recipe = load_recipe(path)
        print(f"{path.stem:32s} {recipe.method:6s} {recipe.model.path}  ({recipe.world_size} process(es))")
    return 0


def add_data(sub) -> None:
    p = sub.add_parser("data", help="look at a recipe's data before training")
    data_sub = p.add_subparsers(dest="data_command", required=True, metavar="DATA_COMMAND")
    q = data_sub.add_parser("inspect", help="rows, tokens, lengths, packing and one sample with its trained tokens")
    q.add_argument("recipe", type=Path)
    common.overrides(q)
    q.add_argument("--no-color", action="store_true", help="mark trained tokens with [[ ]] instead of colour")
    q.set_defaults(func=cmd_data_inspect)


def cmd_data_inspect(args) -> int:
    from homelab_ft.cli.data_inspect import inspect_recipe
    from homelab_ft.recipe.config import load_recipe

    recipe = load_recipe(args.recipe, list(args.overrides))
    color = sys.stdout.isatty() and not args.no_color
    print(inspect_recipe(recipe, base_dir=args.recipe.resolve().parent, color=color))
    return 0
