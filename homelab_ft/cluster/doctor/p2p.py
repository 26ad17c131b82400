"""`homelab-ft doctor`'s check of a pipelined recipe: point-to-point bandwidth between neighbouring stages.

A pipeline's stages exchange activations forward and their gradients backward, one tensor per
micro-batch per boundary (torch.distributed.pipelining posts them as isend/irecv), so what bounds
it is one rank sending to one other, not a collective's bus bandwidth. For each boundary this
times torch.distributed.send of a tensor from the first rank of stage s to the first rank of
stage s+1 and the receiver's 1-element answer (so the time covers delivery), on the run's own
process group and backend. Ranks map to stages as distributed/pipeline.process_groups lays its
(pp, dp) mesh: rank = stage x replicas + replica, so stage s's first replica is rank s x replicas.

Sizes grow 64 KiB -> 1 MiB -> 4 MiB -> 16 MiB until one send takes LONG_ENOUGH_S (the doctor's
collectives stop at the same point), each timed for about TIME_PER_SIZE_S after one untimed send:
a boundary costs about a second whatever the link. The verdict (`stage_lines`) is pure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from homelab_ft.cluster.doctor.report import OK, SLOW_LINK_FRACTION, WARN, Line, rate, size

SIZES_BYTES = (64 * 2**10, 2**20, 4 * 2**20, 16 * 2**20)
TIME_PER_SIZE_S = 0.3
LONG_ENOUGH_S = 0.25
MAX_REPEATS = 50


@dataclass(frozen=True)
class StageLink:
    """One boundary's best send: stage `stage` -> stage + 1, from node `src` to node `dst`."""

    stage: int
    src: str
    dst: str
    nbytes: int
    seconds: float

    @property
    def gbit(self) -> float:
        return self.nbytes * 8 / max(self.seconds, 1e-9) / 1e9


def boundary_ranks(*, stages: int, world_size: int) -> list[tuple[int, int]]:
    """(sender, receiver) of each boundary: the first replica of stage s and of stage s+1."""
    replicas = world_size // stages
    return [(s * replicas, (s + 1) * replicas) for s in range(stages - 1)]


def recipe_stages(recipe, *, world_size: int) -> int:
    """The pipeline stages the recipe names (sharding.pipeline_stages), 1 when it names none, `auto`
    (the planner decides; `plan` says whether it picks a pipeline) or a count that does not divide
    the world (the plan's own line says so)."""
    stages = recipe.sharding.pipeline_stages if recipe is not None else 1
    return stages if isinstance(stages, int) and stages > 1 and world_size % stages == 0 else 1


def _send_once(tensor, ack, *, rank: int, src: int, dst: int) -> None:
    import torch.distributed as dist

    if rank == src:
        dist.send(tensor, dst=dst)
        dist.recv(ack, src=dst)
    else:
        dist.recv(tensor, src=src)
        dist.send(ack, dst=src)


def _time_size(nbytes: int, *, rank: int, src: int, dst: int, device) -> float:
    """Seconds of one send of `nbytes` (and its answer), as the sender sees it."""
    import torch

    tensor = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    ack = torch.zeros(1, dtype=torch.float32, device=device)
    start = time.perf_counter()
    _send_once(tensor, ack, rank=rank, src=src, dst=dst)  # opens the pair's connection; sizes the loop
    first = time.perf_counter() - start
    # both ends must run the same count: the receiver takes the sender's
    repeats = torch.tensor([max(1, min(MAX_REPEATS, int(TIME_PER_SIZE_S / max(first, 1e-6))))], device=device)
    _broadcast_pair(repeats, rank=rank, src=src, dst=dst)
    start = time.perf_counter()
    for _ in range(int(repeats.item())):
        _send_once(tensor, ack, rank=rank, src=src, dst=dst)
    return (time.perf_counter() - start) / int(repeats.item())


def _broadcast_pair(value, *, rank: int, src: int, dst: int) -> None:
    import torch.distributed as dist

    if rank == src:
        dist.send(value, dst=dst)
    else:
        dist.recv(value, src=src)


def time_stage_links(*, stages: int, rank: int, world_size: int, local_world: int, names: list[str],
                     device) -> list[StageLink]:
    """Every boundary's best send (`names`: one per node), the same list on every rank. Boundaries
    are timed one after another; ranks outside a boundary only wait for the gather."""
    import torch.distributed as dist

    mine: list[dict] = []
    for stage, (src, dst) in enumerate(boundary_ranks(stages=stages, world_size=world_size)):
        if rank not in (src, dst):
            continue
        best: tuple[int, float] | None = None
        for nbytes in SIZES_BYTES:
            seconds = _time_size(nbytes, rank=rank, src=src, dst=dst, device=device)
            if best is None or nbytes / seconds > best[0] / best[1]:
                best = (nbytes, seconds)
            if seconds >= LONG_ENOUGH_S:
                break
        if rank == src and best is not None:
            mine.append({"stage": stage, "src": names[src // local_world], "dst": names[dst // local_world],
                         "nbytes": best[0], "seconds": best[1]})
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, mine)
    return sorted((StageLink(**d) for per_rank in gathered for d in per_rank), key=lambda link: link.stage)


def stage_lines(links: list[StageLink], *, expected_gbit: float | None, expected_from: str = "NIC") -> list[Line]:
    """One line per boundary: its send bandwidth, against the NIC's line rate where the nodes report
    one (below SLOW_LINK_FRACTION of it: warn, as for the collectives). Inside one node a boundary
    runs over shared memory or NVLink, so only boundaries between nodes are judged."""
    lines = []
    for link in links:
        check = f"p2p stage {link.stage} -> {link.stage + 1}"
        where = link.src if link.src == link.dst else f"{link.src} -> {link.dst}"
        result = f"{rate(link.gbit)} at {size(link.nbytes)} (send/recv, what a pipeline boundary carries)"
        if link.src != link.dst and expected_gbit and link.gbit < SLOW_LINK_FRACTION * expected_gbit:
            lines.append(Line(check, where, result, WARN,
                              f"the stages' link carries under {SLOW_LINK_FRACTION:.0%} of the {expected_from}'s "
                              f"{rate(expected_gbit)}: each micro-batch's activations wait on it; check `ethtool IF`, "
                              "the cable and switch port, other traffic, or the interface (--iface)"))
        else:
            lines.append(Line(check, where, result, OK))
    return lines


def check(env, recipe, nodes: list, *, local_world: int) -> list[StageLink]:
    """doctor_rank's call on every rank: the boundaries of the recipe's pipeline, none without one."""
    stages = recipe_stages(recipe, world_size=env.world_size)
    if stages == 1:
        return []
    return time_stage_links(stages=stages, rank=env.rank, world_size=env.world_size, local_world=local_world,
                            names=[n.name for n in nodes], device=env.device)


def report_lines(links: list[StageLink] | tuple, nodes: list) -> list[Line]:
    """`stage_lines` against the slowest NIC, when every node reports its line rate."""
    nic = [n.nic_speed_mbit for n in nodes if n.nic_speed_mbit]
    return stage_lines(links, expected_gbit=min(nic) / 1000 if nic and len(nic) == len(nodes) else None)
