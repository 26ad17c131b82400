"""`homelab-ft launch` and `doctor`: the commands for several machines.

`launch` plans and checks the inputs once, here (cli/train.py's `planned` and `checked_handoff`),
and puts the same handoff on every node's command line, so no node plans or probes again.
"""

from __future__ import annotations

from pathlib import Path

from homelab_ft.cli import args as common
from homelab_ft.errors import UserError


def add_launch(sub) -> None:
    from homelab_ft.cluster.launch import DEFAULT_PORT

    p = sub.add_parser("launch", help="print (or run over ssh) each node's torchrun command for a multi-node recipe")
    p.add_argument("recipe")
    common.overrides(p)
    p.add_argument("--hosts", type=Path, required=True, help="hostfile: one host per line, the head node first")
    common.run_dir(p)
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="rendezvous TCP port on the head node")
    p.add_argument("--iface", help="network interface to use (sets NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME)")
    p.add_argument("--workdir", help="directory of this checkout on every node (default: the current one)")
    p.add_argument("--join-timeout", type=int, default=300, help="seconds to wait for all nodes to join")
    p.add_argument("--run", action="store_true", help="start the commands over ssh instead of printing them")
    common.cluster_file(p)
    p.set_defaults(func=cmd_launch)


def launch_commands(args) -> list:
    """Each node's command for `launch`: the recipe planned and its inputs checked here, once; the
    file's values and `--run-dir` (as `output.dir=`) stay on every node's command line as overrides
    (the other nodes need not have the file)."""
    from homelab_ft.cli.train import checked_handoff, planned
    from homelab_ft.cluster import launch
    from homelab_ft.recipe.config import load_recipe

    overrides = common.with_run_dir(args, common.with_cluster_file(args, list(args.overrides)))
    recipe = load_recipe(args.recipe, overrides)
    hosts = launch.read_hosts(args.hosts, nodes=recipe.cluster.nodes, port=args.port)  # before planning: it is cheap
    plan, rung = planned(recipe, cluster_file=common.cluster_file_name(args), base_dir=Path(args.recipe).resolve().parent)
    handoff, _ = checked_handoff(recipe, plan=plan, rung=rung)
    return launch.launch_commands(hosts, args.recipe, overrides, handoff=handoff, port=args.port,
                                  iface=args.iface, workdir=args.workdir, join_timeout_s=args.join_timeout,
                                  num_threads=recipe.train.num_threads)


def cmd_launch(args) -> int:
    from homelab_ft.cluster.launch import run_over_ssh

    commands = launch_commands(args)
    if args.run:
        return run_over_ssh(commands)
    print("# each command carries this launch's plan and checked inputs ($HOMELAB_FT_HANDOFF): "
          "run `homelab-ft launch` again to resume or start another run")
    _print_commands(commands)
    return 0


def _print_commands(commands) -> None:
    for command in commands:
        print(f"# on {command.host.address}:")
        print(command.shell_line())


def add_doctor(sub) -> None:
    from homelab_ft.cluster.launch import DEFAULT_PORT

    p = sub.add_parser("doctor", help="check this machine or a cluster through the launcher a run uses; measure its links")
    p.add_argument("recipe", nargs="?", help="also check disk and host RAM against what `plan` needs for this recipe")
    common.overrides(p)
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
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args) -> int:
    """Exit 0 when every line is ok or warn, 2 when one FAILs (or a check before launch fails)."""
    from homelab_ft.cluster import launch
    from homelab_ft.cluster.doctor import check as doctor
    from homelab_ft.cluster.handoff import under_torchrun

    if under_torchrun():
        return _doctor_rank(args)
    worker_args = [f"--join-timeout={args.join_timeout}", *common.verbosity_flags(args)]
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
    _print_commands(started.commands)
    return 0


def _doctor_rank(args) -> int:
    from homelab_ft.cluster.doctor.rank import run_rank

    outcome = run_rank(recipe_path=args.recipe, overrides=list(args.overrides), iface=args.iface,
                       run_dir=args.run_dir, out=args.out, join_timeout_s=args.join_timeout)
    if outcome.table is not None:
        print(outcome.table)
        if outcome.error:
            raise UserError(outcome.error)
        if outcome.written:
            print(f"\nwrote {outcome.written}: pass it to plan and train with --cluster {outcome.written}")
    return outcome.code
