"""Two machines on one: Linux network namespaces joined by a shaped veth pair.

Each namespace is a separate network host (its own interfaces, routes and ports), so processes
started in them talk over real TCP through the veth pair, and `tc` shapes that pair like an
Ethernet link: `tbf` for the rate, `netem` for delay and loss. The tests and bench/network.py use
it to run a 2-node cluster (doctor, torchrun rendezvous, FSDP2/DDP over gloo) on this machine.

Only addresses inside the namespaces made here are used (10.211.N.1 and .2), nothing is routed
anywhere else, and the namespaces (with their veth ends) are removed on exit, also when the body
raises. Namespaces left by a killed test run are swept on the next use: their names carry the PID
that made them, and one whose PID is gone is deleted. Needs root and iproute2 (`ip`, `tc`);
`unavailable()` says why not when they are missing, for a skip.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

PREFIX = "hftns"
IFACE = "lan0"
"""The interface name on both nodes, as on two real machines (`--iface lan0`)."""
_counter = itertools.count()


@dataclass(frozen=True)
class Node:
    ns: str
    addr: str
    iface: str = IFACE

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]


@dataclass(frozen=True)
class Link:
    nodes: tuple[Node, Node]
    rate_mbit: float | None
    delay_ms: float
    loss_pct: float


def unavailable() -> str | None:
    """Why namespaces cannot be made here (for pytest.skip), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


def _run(*argv: str) -> None:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.stdout.strip()}")


def sweep_stale() -> None:
    """Delete namespaces of ours whose creating process is gone (a killed test run)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def _shape(ns: str, iface: str, *, rate_mbit: float | None, delay_ms: float, loss_pct: float) -> None:
    """Egress shaping of one veth end; both ends shaped make a symmetric full-duplex link."""
    if delay_ms or loss_pct:
        netem = ["netem"]
        if delay_ms:
            netem += ["delay", f"{delay_ms}ms"]
        if loss_pct:
            netem += ["loss", f"{loss_pct}%"]
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", iface, "root", "handle", "1:", *netem)
        parent = ["parent", "1:1", "handle", "10:"]
    else:
        parent = ["root"]
    if rate_mbit:
        # burst: at least one rate-tick's worth (rate/HZ with HZ=250) and several full frames
        burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 / 250))
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", iface, *parent, "tbf",
             "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "400ms")


@contextlib.contextmanager
def shaped_link(rate_mbit: float | None = None, *, delay_ms: float = 0.0, loss_pct: float = 0.0) -> Iterator[Link]:
    """Two namespaces joined by a veth pair shaped to `rate_mbit` (None: unshaped), with `delay_ms`
    one-way delay and `loss_pct` packet loss on each direction."""
    reason = unavailable()
    if reason:
        raise RuntimeError(reason)
    sweep_stale()
    n = next(_counter)
    tag = f"{os.getpid()}-{n}"
    subnet = 10 + (os.getpid() * 7 + n) % 240
    nodes = (Node(f"{PREFIX}{tag}-a", f"10.211.{subnet}.1"), Node(f"{PREFIX}{tag}-b", f"10.211.{subnet}.2"))
    made: list[str] = []
    try:
        for node in nodes:
            _run("ip", "netns", "add", node.ns)
            made.append(node.ns)
            _run("ip", "-n", node.ns, "link", "set", "lo", "up")
        # temporary names in the root namespace, unique per pair; renamed to lan0 inside each node
        a_tmp, b_tmp = f"hv{os.getpid() % 100000}x{n}a", f"hv{os.getpid() % 100000}x{n}b"
        _run("ip", "link", "add", a_tmp, "netns", nodes[0].ns, "type", "veth", "peer", "name", b_tmp,
             "netns", nodes[1].ns)
        for node, tmp in zip(nodes, (a_tmp, b_tmp), strict=True):
            _run("ip", "-n", node.ns, "link", "set", tmp, "name", node.iface)
            _run("ip", "-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", node.iface)
            _run("ip", "-n", node.ns, "link", "set", node.iface, "up")
            _shape(node.ns, node.iface, rate_mbit=rate_mbit, delay_ms=delay_ms, loss_pct=loss_pct)
        yield Link(nodes=nodes, rate_mbit=rate_mbit, delay_ms=delay_ms, loss_pct=loss_pct)
    finally:
        for ns in made:
            _kill_inside(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _kill_inside(ns: str) -> None:
    """Processes still running inside a namespace (a node that hung) are killed before it goes."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout
    for pid in out.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)
