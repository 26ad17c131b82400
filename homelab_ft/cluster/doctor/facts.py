"""What `homelab-ft doctor` learns about a cluster: each node's report, the timed collectives and
what the plan needs, as JSON-able dataclasses, with the bandwidth arithmetic. No torch, no I/O.

doctor_rank.py fills them on every node; doctor_report.py turns them into verdicts and the table.

Bandwidth is reported as the *bus bandwidth* of a ring collective (NCCL-tests' busbw): the bytes
each rank sends per second, in Gbit/s, which is directly comparable to the line rate of the link
between two nodes. A ring all-reduce of S bytes over n ranks sends 2 (n-1)/n x S per rank
(reduce-scatter, then all-gather); an all-gather of S bytes per rank sends (n-1) x S per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NodeFacts:
    """What one node reported (from its local rank 0); JSON-able, so it also goes into `measured:`."""

    name: str
    """How the table names the node: the address it reached the rendezvous from, or, on one
    machine, its host name."""
    hostname: str
    versions: dict[str, str | None]
    nproc: int
    device: str
    """`cuda` or `cpu`: what the ranks of this node compute on."""
    gpus: list[dict] = field(default_factory=list)
    """Per local GPU: name, memory_bytes, capability (e.g. "8.6"), bf16."""
    no_peer_access: list[list[int]] = field(default_factory=list)
    """Pairs of local GPUs that cannot reach each other's memory directly (peer-to-peer)."""
    nvlink: bool = False
    address: str = ""
    iface: str | None = None
    """The interface holding `address` (the one the rendezvous and gloo used)."""
    iface_given: str | None = None
    nic_speed_mbit: int | None = None
    """/sys/class/net/IF/speed: the negotiated line rate, when the driver reports one."""
    probe_dir: str = ""
    writable: bool = True
    sees_token: bool | None = None
    """Whether this node found the token rank 0 wrote into the run directory; None on rank 0's node."""
    free_disk_bytes: int | None = None
    host_ram_bytes: int = 0
    available_ram_bytes: int = 0
    cpu_gflops_per_core: float | None = None
    """fp32 matmul GFLOPS of one core (plan/hardware.py: cpu_matmul_gflops), measured on a CPU node."""


@dataclass(frozen=True)
class Timing:
    """One timed collective: `nbytes` per rank (the all-reduce's tensor, the all-gather's input)."""

    op: str
    nbytes: int
    seconds: float
    ranks: int

    @property
    def sent_bytes(self) -> float:
        return sent_bytes_per_rank(self.op, self.nbytes, self.ranks)

    @property
    def bus_gbit(self) -> float:
        return bus_gbit(self.op, self.nbytes, self.seconds, self.ranks)


def sent_bytes_per_rank(op: str, nbytes: int, ranks: int) -> float:
    """Bytes each rank sends in a ring `op` over `ranks` ranks (see the module docstring)."""
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks * nbytes
    if op == "all_gather":
        return (ranks - 1) * nbytes
    raise ValueError(op)


def bus_gbit(op: str, nbytes: int, seconds: float, ranks: int) -> float:
    return sent_bytes_per_rank(op, nbytes, ranks) * 8 / 1e9 / seconds


@dataclass(frozen=True)
class LinkResult:
    """The collectives timed over one group: one rank per node (`inter`), or one node's ranks."""

    scope: str
    """`inter-node` or `intra-node`."""
    where: str
    ranks: int
    backend: str
    timings: tuple[Timing, ...]

    def best(self, op: str) -> Timing | None:
        """The timing that stands for the link. Between nodes: the largest size, the asymptote that
        big transfers see (smaller ones can ride a switch's or shaper's burst allowance: 64 KiB read
        187 Mbit/s on a 200 Mbit/s tbf link whose 4 MiB read 128). Inside a node: the highest bus
        bandwidth (NCCL-tests' peak busbw); on CPU the largest buffers outgrow the caches."""
        mine = [t for t in self.timings if t.op == op and t.nbytes > 4]
        if not mine:
            return None
        if self.scope == "inter-node":
            return max(mine, key=lambda t: t.nbytes)
        return max(mine, key=lambda t: t.bus_gbit)

    @property
    def latency_ms(self) -> float | None:
        small = [t for t in self.timings if t.op == "all_reduce"]
        return min(small, key=lambda t: t.nbytes).seconds * 1e3 if small else None

    @property
    def gbit(self) -> float | None:
        """The link's bandwidth for the cluster file: the all-reduce's best bus bandwidth."""
        big = self.best("all_reduce")
        return big.bus_gbit if big else None

    def to_dict(self) -> dict:
        return {"scope": self.scope, "where": self.where, "ranks": self.ranks, "backend": self.backend,
                "latency_ms": _round(self.latency_ms),
                "results": [{"op": t.op, "bytes": t.nbytes, "seconds": round(t.seconds, 6),
                             "bus_gbit": round(t.bus_gbit, 4)} for t in self.timings]}


@dataclass(frozen=True)
class Needs:
    """What `plan` says one node needs for the recipe (planner.plan_for_recipe)."""

    recipe: str
    option: str | None
    """The chosen rung's label, or None when nothing fits."""
    host_ram_bytes: int = 0
    disk_bytes: int = 0
    """keep_last + 1 checkpoints, the most a run holds at once (diskspace.space_warning)."""
    problem: str = ""
    """Why the plan could not be made or what in the recipe disagrees with this cluster."""


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)
