"""Starting the processes of a multi-process run: torchrun on one machine, or on several over ssh.

The command-building functions are pure (lists of strings in, lists of strings out) and are what
the unit tests check; only `reexec_under_torchrun` and `run_over_ssh` start processes.

We launch with torchrun (`python -m torch.distributed.run`), never `accelerate launch`: on CPU
the latter silently trains every process alone instead of sharding (measured with accelerate 1.15).
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from homelab_ft import fsio
from homelab_ft.cluster.handoff import HANDOFF_VAR, Handoff
from homelab_ft.errors import UserError

DEFAULT_PORT = 29500
"""torchrun's own default rendezvous port; open it (TCP) between the nodes. `doctor` uses it too."""


@dataclass(frozen=True)
class Host:
    address: str
    """What ssh connects to: `host`, `user@host` or an ssh config alias."""
    rdzv_address: str
    """The address the other nodes reach this one at (the host part, without `user@`)."""


@dataclass(frozen=True)
class NodeCommand:
    host: Host
    argv: list[str]
    """The command to run on that node (torchrun and its arguments)."""
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None

    def shell_line(self) -> str:
        """One line to paste into a shell on the node."""
        parts = []
        if self.workdir:
            parts.append(f"cd {shlex.quote(self.workdir)} &&")
        parts += [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        parts += [shlex.quote(a) for a in self.argv]
        return " ".join(parts)


def standalone_command(
    recipe_path: str | None, train_args: list[str], *, nproc_per_node: int, python: str = sys.executable,
    command: str = "train",
) -> list[str]:
    """`homelab-ft train` (or `doctor`: `command`) re-run under torchrun on this machine
    (`--standalone`: a local rendezvous on a free port, so two runs on one machine do not collide).
    torchrun's agent runs inside `homelab_ft.cluster.supervise`, which reports a failed rank in one line
    (see there)."""
    return [
        python, "-m", "homelab_ft.cluster.supervise", "--standalone", f"--nproc-per-node={nproc_per_node}",
        *_subcommand(command, recipe_path, train_args),
    ]


def _subcommand(command: str, recipe_path: str | None, args: list[str]) -> list[str]:
    return ["-m", "homelab_ft", command, *([recipe_path] if recipe_path else []), *args]


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def run_supervised(argv: list[str], *, env: dict[str, str]) -> int:
    """Run torchrun as a child that never outlives this process; returns its exit code.

    torchrun gets its own session, so Ctrl-C in a terminal reaches it once, through us, instead
    of twice (the terminal's and ours): a second signal cuts its graceful shutdown short. SIGTERM,
    SIGINT and SIGHUP are forwarded once and we wait for torchrun, which forwards them to every
    rank and waits for their checkpoint. If this process is killed outright (SIGKILL), the kernel
    sends torchrun SIGTERM (PR_SET_PDEATHSIG), so the ranks still stop and save.
    """
    proc = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_term_on_parent_death)
    received: list[int] = []

    def forward(signum, _frame):
        if not received:
            received.append(signum)
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:  # a SIGINT that arrived before our handler was installed
                forward(signal.SIGINT, None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code if code >= 0 else 128 - code


def _term_on_parent_death() -> None:
    """In the child, before exec: ask Linux for SIGTERM when the parent dies (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)


SHUTDOWN_GRACE_S = 30
"""torchrun's own default wait between forwarding a signal and SIGKILL."""
CHECKPOINT_WRITE_BYTES_PER_S = 100e6
"""A slow disk: a hard disk or a busy NAS writes ~100-150 MB/s; SSDs several times that."""


def shutdown_timeout_s(plan: dict) -> int:
    """Seconds torchrun waits for the ranks after forwarding SIGTERM/SIGINT before SIGKILL: its
    30 s, plus the step in progress twice over (as the plan prices it) and the checkpoint written
    at a slow disk's speed (1.5 GB: +15 s; a 1B full fine-tune's 7 GB: +70 s). Too short, and a
    rank is killed mid-save: the previous checkpoint stays, but the stop loses its steps.
    `plan` is `Plan.to_dict()`, as handed to the workers."""
    chosen = plan.get("chosen")
    if not chosen:
        return SHUTDOWN_GRACE_S
    return int(SHUTDOWN_GRACE_S + 2 * chosen["step_s"] + (plan.get("checkpoint_bytes") or 0) / CHECKPOINT_WRITE_BYTES_PER_S)


def memory_note(plan: dict) -> str:
    """What the planner expects a node to need (from `Plan.to_dict()`), for the line that reports
    a killed rank."""
    chosen = plan.get("chosen")
    if not chosen:
        return ""
    return (f"the plan expects {chosen['host_bytes'] / 2**30:.1f} GiB of host RAM per node of "
            f"{plan['cluster']['host_ram_bytes'] / 2**30:.1f} GiB, {chosen['memory']['total'] / 2**30:.1f} GiB per device")


def parse_hostfile(text: str, *, source: str = "hostfile") -> list[Host]:
    """One host per line (`host`, `user@host`, an IP); `#` starts a comment. The first is the head.

    A trailing `slots=N` (the MPI/DeepSpeed convention) is accepted and ignored: the recipe's
    `cluster.gpus_per_node` says how many processes each node runs, so the two cannot disagree.
    """
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        extra = [w for w in words[1:] if not w.startswith("slots=")]
        if extra:
            raise UserError(f"{source} line {number}: expected one host per line, got {line!r}")
        address = words[0]
        check_host(address, where=f"{source} line {number}")
        hosts.append(Host(address=address, rdzv_address=address.rsplit("@", 1)[-1]))
    if not hosts:
        raise UserError(f"{source} lists no hosts; write one host name or IP per line, the head node first")
    seen = [h.rdzv_address for h in hosts]
    if len(set(seen)) != len(seen):
        raise UserError(f"{source} lists a host twice: {', '.join(seen)}")
    return hosts


_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$")
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?$")


def check_host(address: str, *, where: str) -> None:
    """`host`, `user@host`, an IPv4/IPv6 address or an ssh config alias, and nothing else.

    The entry becomes an ssh argument and a torchrun rendezvous endpoint: a word starting with
    `-` would reach ssh as an option (`-oProxyCommand=...` runs a command), and shell or URL
    characters have no place in either.
    """
    user, _, host = address.rpartition("@")
    ok = (not user or _USER.match(user)) and (_HOSTNAME.match(host) or _is_ip(host))
    if not ok:
        raise UserError(
            f"{where}: {address!r} is not a host name or address; write `host`, `user@host` or an IP "
            "(letters, digits, '.', '-' and '_' only, not starting with '-')"
        )


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def node_commands(
    hosts: list[Host],
    recipe_path: str | None,
    train_args: list[str],
    *,
    nodes: int,
    nproc_per_node: int,
    port: int = DEFAULT_PORT,
    iface: str | None = None,
    join_timeout_s: int = 300,
    run_id: str | None = None,
    workdir: str | None = None,
    python: str = "python",
    num_threads: int | None = None,
    command: str = "train",
    handoff: Handoff | None = None,
) -> list[NodeCommand]:
    """The torchrun command for each node, with c10d rendezvous on the head node (the first host).

    c10d needs no extra service: the agent on the head node hosts the store. Ranks are assigned
    node by node (rank = node * nproc_per_node + local_rank), which HYBRID_SHARD's 2-D mesh relies
    on to put each shard group inside one node. `join_timeout_s` bounds the wait for the other
    nodes, so a wrong address ends with an error rather than a hang; the agent runs inside
    `homelab_ft.cluster.supervise` (torchrun's own agent), which turns that timeout into one line naming
    the nodes of the hostfile ($HOMELAB_FT_NODES) that may be missing.

    `--local-addr` is the node's hostfile address: without it the node that becomes rank 0 tells
    the others to reach its workers at its host name, which Debian and Ubuntu map to 127.0.1.1 in
    /etc/hosts, so the other nodes' workers would look for it on themselves. `command` is the
    subcommand the workers run (`train`, or `doctor` to check the same path). `handoff`, the
    launching machine's decision, goes on every node's command line (handoff.py), so no worker
    plans, probes its hardware or repeats the checks.
    """
    _check_hosts_and_port(hosts, nodes=nodes, port=port)
    run_id = run_id or uuid.uuid4().hex[:8]
    head = hosts[0].rdzv_address
    env = _node_env(hosts, iface=iface, num_threads=num_threads, handoff=handoff)
    argv_tail = _subcommand(command, recipe_path, train_args)
    commands = []
    for number, host in enumerate(hosts):
        argv = [
            python, "-m", "homelab_ft.cluster.supervise",
            f"--nnodes={nodes}",
            f"--nproc-per-node={nproc_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={head}:{port}",
            f"--rdzv-id={run_id}",
            # Who hosts the store is said, not guessed: torch guesses from the IPs the machine's
            # hostname resolves to, which misses the LAN address where /etc/hosts maps the name to
            # 127.0.1.1 or the address of a second NIC (the head then waits for a store nobody
            # starts). read_timeout: how long a node waits to reach the head's store (torch's 60 s
            # otherwise). --local-addr is the address the others reach this node at; by default
            # torchrun advertises socket.getfqdn(), which may resolve to another NIC.
            f"--rdzv-conf=join_timeout={join_timeout_s},read_timeout={join_timeout_s},is_host={str(number == 0).lower()}",
            f"--local-addr={host.rdzv_address}",
            *argv_tail,
        ]
        commands.append(NodeCommand(host=host, argv=argv, env=dict(env), workdir=workdir))
    return commands


def _check_hosts_and_port(hosts: list[Host], *, nodes: int, port: int) -> None:
    if len(hosts) != nodes:
        raise UserError(
            f"the hostfile lists {len(hosts)} host(s) but the recipe's cluster.nodes is {nodes}; "
            f"make them agree (or override cluster.nodes={len(hosts)})"
        )
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port} is not a TCP port (1-65535)")


def _node_env(hosts: list[Host], *, iface: str | None, num_threads: int | None, handoff: Handoff | None) -> dict[str, str]:
    """The variables every node's command sets: the interface, threads, the hostfile's nodes (for
    supervise's one-line report) and the launching machine's handoff."""
    from homelab_ft.cluster.supervise import NODES_VAR

    env: dict[str, str] = {}
    if iface:
        # Both libraries otherwise pick the first interface they find, often docker0 or a VPN.
        env["NCCL_SOCKET_IFNAME"] = iface
        env["GLOO_SOCKET_IFNAME"] = iface
    if num_threads:
        env["OMP_NUM_THREADS"] = str(num_threads)
    env[NODES_VAR] = ",".join(h.rdzv_address for h in hosts)
    if handoff is not None:
        env[HANDOFF_VAR] = handoff.encode()
    return env


def ssh_argv(command: NodeCommand) -> list[str]:
    """ssh with no password prompt (BatchMode): a missing key fails at once instead of waiting."""
    # `--`: nothing after it is read as an ssh option, whatever the hostfile held.
    return ["ssh", "-o", "BatchMode=yes", "--", command.host.address, command.shell_line()]


def run_over_ssh(commands: list[NodeCommand]) -> int:
    """Start every node's command over ssh, stream their output, stop all if one fails."""
    procs = [subprocess.Popen(ssh_argv(c)) for c in commands]
    code = 0
    try:
        for proc in procs:
            code = proc.wait() or code
            if code:
                break
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
    return code


def run_workers(recipe, recipe_path: str, train_args: list[str], *, handoff: Handoff) -> int:
    """Re-run `homelab-ft train` under torchrun on this machine (several processes, or one that
    needs a process group anyway: FSDP on a single GPU to offload to the CPU), handing the
    workers this process's decision. Returns torchrun's exit code. A multi-node recipe needs
    `homelab-ft launch`."""
    rung = handoff.rung
    if rung.nodes > 1:
        raise UserError(
            f"{recipe_path} spans {rung.nodes} nodes; start it on every node with "
            f"`homelab-ft launch --hosts HOSTFILE {recipe_path}` (see docs/multi-node.md)"
        )
    argv = standalone_command(recipe_path, train_args, nproc_per_node=rung.procs_per_node)
    from homelab_ft.cluster.supervise import MEMORY_NOTE_VAR

    env = dict(os.environ)
    env[HANDOFF_VAR] = handoff.encode()
    if recipe.train.num_threads:
        env["OMP_NUM_THREADS"] = str(recipe.train.num_threads)
    env[MEMORY_NOTE_VAR] = memory_note(handoff.plan)
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(shutdown_timeout_s(handoff.plan)))
    return run_supervised(argv, env=env)


def read_hosts(hostfile: Path, *, nodes: int, port: int) -> list[Host]:
    """The hostfile's hosts, checked against the recipe's cluster.nodes and the port: what `launch`
    reads first, before it plans or checks anything costlier."""
    path = Path(hostfile)
    if not path.is_file():
        raise UserError(f"hostfile {path} not found; write one host per line, the head node first")
    hosts = parse_hostfile(fsio.read_text(path, what="hostfile"), source=str(path))
    _check_hosts_and_port(hosts, nodes=nodes, port=port)
    return hosts


def launch_commands(
    hosts: list[Host], recipe_path: str, train_args: list[str], *, handoff: Handoff, port: int, iface: str | None,
    workdir: str | None = None, join_timeout_s: int = 300, num_threads: int | None = None,
) -> list[NodeCommand]:
    """`homelab-ft launch`: each node's command, all carrying the one `handoff` planned and checked
    where `launch` ran; the job's shape (nodes x processes per node) is the handoff's rung. `hosts`:
    `read_hosts`' (the command reads the hostfile first, before planning)."""
    return node_commands(
        hosts, recipe_path, train_args,
        nodes=handoff.rung.nodes,
        nproc_per_node=handoff.rung.procs_per_node,
        port=port,
        iface=iface,
        join_timeout_s=join_timeout_s,
        workdir=workdir or os.getcwd(),
        num_threads=num_threads,
        # This checkout's interpreter (its .venv); the docs ask for the same path on every node.
        python=sys.executable,
        handoff=handoff,
    )
