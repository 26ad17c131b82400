"""`homelab-ft doctor`: check a cluster through the same launcher a run uses, and measure its links.

Two halves, like `train`:
- before launch (this process, torch-free): the checks that can be made from here, each a one-line
  UserError naming the node and the fix: an interface name this machine does not have, a
  rendezvous port already taken on the head, a host ssh cannot reach (`--run`). Then the same
  torchrun commands `launch` builds (launch.node_commands / standalone_command), with `doctor` as
  the subcommand, so the rendezvous, `--iface`, ports and join timeout are exactly a run's.
- under torchrun (every rank): doctor_rank.py.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from homelab_ft import fsio
from homelab_ft.cluster import launch
from homelab_ft.errors import UserError
from homelab_ft.plan import hardware

SSH_CONNECT_TIMEOUT_S = 5


def check_iface(iface: str | None) -> None:
    """`--iface` must name an interface of this machine (the others check their own)."""
    if not iface:
        return
    names = [name for _, name in socket.if_nameindex()]
    if iface not in names:
        raise UserError(f"--iface {iface}: no such network interface on this machine ({socket.gethostname()}; it has "
                        f"{', '.join(names)}); pass the LAN interface's name as `ip -br addr` shows it")


def is_local_address(host: str) -> bool:
    """Whether `host` resolves to an address of this machine (binding to it succeeds)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((sockaddr[0], 0))
            except OSError:
                continue
            return True
    return False


def check_port(head: str, port: int) -> None:
    """On the head: the rendezvous port must be free (torchrun's store would otherwise connect to
    whatever holds it and wait there until the join timeout)."""
    family = socket.AF_INET6 if ":" in head else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # as the store binds: TIME_WAIT leftovers of an earlier run do not count as in use
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("::" if family == socket.AF_INET6 else "", port))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            raise UserError(f"--port {port}: TCP port {port} is already in use on the head node {head} (another run's "
                            "rendezvous or another service); stop that, or choose a free port with --port") from None


def ssh_check_argv(address: str) -> list[str]:
    """A no-op over ssh: BatchMode never prompts, ConnectTimeout bounds a dead host's wait."""
    return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}", "--", address, "true"]


def check_reachable(hosts: list[launch.Host], *, hostfile: str) -> None:
    """Every host answers over ssh (all at once, so N dead hosts cost one timeout)."""
    def probe(host: launch.Host) -> str | None:
        try:
            proc = subprocess.run(ssh_check_argv(host.address), capture_output=True, text=True,
                                  timeout=SSH_CONNECT_TIMEOUT_S + 10, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return f"{host.address} (no answer within {SSH_CONNECT_TIMEOUT_S + 10} s)"
        if proc.returncode == 0:
            return None
        reason = (proc.stderr.strip().splitlines() or [f"ssh exit {proc.returncode}"])[-1]
        return f"{host.address} ({reason})"

    with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
        failures = [f for f in pool.map(probe, hosts) if f]
    if failures:
        raise UserError(f"{hostfile}: ssh cannot reach {'; '.join(failures)}; check that the node is up, its address "
                        "in the hostfile and passwordless ssh (`ssh-copy-id HOST`), or run the printed commands by "
                        "hand without --run")


@dataclass(frozen=True)
class Launch:
    """What `homelab-ft doctor` starts: this machine alone (`argv`), or one command per node."""

    argv: list[str] | None = None
    env: dict[str, str] | None = None
    commands: list[launch.NodeCommand] | None = None


def prepare(*, recipe_path: str | None, overrides: list[str], hostfile: str | None, iface: str | None, port: int,
            nproc_per_node: int | None, run: bool, worker_args: list[str], join_timeout_s: int,
            workdir: str | None = None) -> Launch:
    """Check what can be checked here, then build the torchrun command(s) with launch.py."""
    recipe = None
    if recipe_path:
        from homelab_ft.recipe.config import load_recipe

        recipe = load_recipe(recipe_path, overrides)  # a broken recipe stops here, before any launch
    if run and not hostfile:
        raise UserError("--run starts the nodes of a hostfile over ssh; add --hosts HOSTFILE, or drop --run to check "
                        "this machine alone")
    if nproc_per_node is None:
        detected = hardware.detect().gpu_count
        # CPU: two processes on one machine, so there are collectives to time; one per node across nodes
        nproc_per_node = recipe.cluster.gpus_per_node if recipe else (detected or (1 if hostfile else 2))
    if nproc_per_node < 1:
        raise UserError(f"--nproc-per-node {nproc_per_node}: needs at least 1 process per node")
    args = [*overrides, *worker_args]
    if not hostfile:
        check_iface(iface)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")  # timing collectives needs no compute threads
        if iface:
            env.update(NCCL_SOCKET_IFNAME=iface, GLOO_SOCKET_IFNAME=iface)
        return Launch(argv=launch.standalone_command(recipe_path, args, nproc_per_node=nproc_per_node, command="doctor"),
                      env=env)
    path = Path(hostfile)
    if not path.is_file():
        raise UserError(f"hostfile {path} not found; write one host per line, the head node first")
    hosts = launch.parse_hostfile(fsio.read_text(path, what="hostfile"), source=str(path))
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port} is not a TCP port (1-65535)")
    if is_local_address(hosts[0].rdzv_address):
        # this machine is the head: its interface and port are checked here (elsewhere, by the workers)
        check_iface(iface)
        check_port(hosts[0].rdzv_address, port)
    if run:
        check_reachable(hosts, hostfile=str(path))
    commands = launch.node_commands(hosts, recipe_path, args, nodes=len(hosts), nproc_per_node=nproc_per_node,
                                    port=port, iface=iface, join_timeout_s=join_timeout_s,
                                    workdir=workdir or os.getcwd(), python=sys.executable, num_threads=1,
                                    command="doctor")
    return Launch(commands=commands)
