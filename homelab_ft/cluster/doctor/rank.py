"""`homelab-ft doctor` on each rank, under torchrun: facts, timed collectives, the report.

doctor.py starts these processes through launch.py. Here, every rank joins the process group on
the real backend (NCCL on CUDA, gloo on CPU); each node's local rank 0 reports its facts (versions,
GPUs, the interface the rendezvous went over, disk, RAM, whether it sees a token file rank 0 wrote
into the run directory); the collectives are timed between nodes (one rank per node) and inside
each node; rank 0 turns it all into the table (doctor_report.py) and writes the cluster file
(clusterfile.py). Every rank returns the same exit code.

Timing stays short: sizes grow from 4 bytes in x4-x16 steps until one operation takes 0.25 s
(past that, per-message latency is under 1% of it), each size timed for about 0.3 s after one
untimed operation, so a link costs a few seconds of all-reduce and all-gather whatever its speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import platform
import secrets
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from homelab_ft import host
from homelab_ft.cluster.doctor import p2p as doctor_p2p
from homelab_ft.cluster.doctor.facts import LinkResult, Needs, NodeFacts, Timing
from homelab_ft.cluster.launch import DEFAULT_PORT
from homelab_ft.errors import UserError
from homelab_ft.plan import hardware

log = logging.getLogger(__name__)

SIZES_BYTES = (4, 64 * 2**10, 2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20)
TIME_PER_SIZE_S = 0.3
LONG_ENOUGH_S = 0.25
MAX_REPEATS = 50
MIN_TIMED = 2
TOKEN_PREFIX = ".homelab-ft-doctor-"


# ------------------------------------------------------------------------------------------------
# facts


def versions() -> dict[str, str | None]:
    """Installed versions as pip sees them (distribution metadata), CUDA and NCCL as torch was built."""
    from importlib import metadata

    import torch

    import homelab_ft

    found: dict[str, str | None] = {"python": platform.python_version()}
    for key in ("torch", "transformers", "peft", "bitsandbytes"):
        try:
            found[key] = metadata.version(key)
        except metadata.PackageNotFoundError:
            found[key] = None
    found["cuda"] = torch.version.cuda
    found["nccl"] = None
    if torch.cuda.is_available():
        nccl = torch.cuda.nccl.version()  # (2, 27, 3); an int such as 2708 from torch before 1.13
        found["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    found["homelab-ft"] = homelab_ft.__version__
    return found


def gpu_facts() -> tuple[list[dict], list[list[int]]]:
    """This node's GPUs and the pairs without peer-to-peer access (CUDA only)."""
    import torch

    count = torch.cuda.device_count()
    gpus = []
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        # bf16 tensor cores arrived with Ampere (compute capability 8.0); older GPUs emulate it slowly
        gpus.append({"name": props.name, "memory_bytes": int(props.total_memory),
                     "capability": f"{props.major}.{props.minor}", "bf16": props.major >= 8,
                     "matmul_tflops": round(matmul_tflops(torch.device("cuda", i), bf16=props.major >= 8), 1)})
    no_peer = [[a, b] for a in range(count) for b in range(a + 1, count)
               if not (torch.cuda.can_device_access_peer(a, b) and torch.cuda.can_device_access_peer(b, a))]
    return gpus, no_peer


MATMUL_SIZE = 8192
"""A square bf16 matmul this big (1.1 TFLOP) keeps every tensor core of the largest GPUs busy
(cuBLAS reaches its plateau from ~4096 on an H100) and takes 5-45 ms on homelab cards."""
MATMUL_TIME_S = 0.3


def matmul_tflops(device, *, bf16: bool = True) -> float:
    """Dense matmul throughput of one GPU in TFLOPS: a timed MATMUL_SIZE^3 matmul, in bf16 (fp16 on
    GPUs without bf16), repeated for about MATMUL_TIME_S after two untimed ones, best of the timed
    runs (the planner's peak figure; gpus.throughput applies its MFU to it)."""
    import torch

    n = MATMUL_SIZE
    dtype = torch.bfloat16 if bf16 else torch.float16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        torch.matmul(a, b)
    torch.cuda.synchronize(device)
    best, spent = float("inf"), 0.0
    while spent < MATMUL_TIME_S or best == float("inf"):
        start = time.perf_counter()
        torch.matmul(a, b)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        best, spent = min(best, seconds), spent + seconds
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / best / 1e12


def local_address() -> str:
    """This node's address towards the rendezvous (MASTER_ADDR): the source address the kernel
    picks for it, i.e. the one the node reached the rendezvous with. A UDP connect sends nothing."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", str(DEFAULT_PORT)))
    for family, _, _, _, sockaddr in socket.getaddrinfo(master, port, type=socket.SOCK_DGRAM):
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            try:
                sock.connect(sockaddr)
            except OSError:
                continue
            return sock.getsockname()[0]
    return "?"


def probe_dir_of(run_dir: str) -> Path:
    """The run directory, or its nearest existing parent (doctor creates nothing there but a token)."""
    path = Path(run_dir).resolve()
    while not path.exists():
        path = path.parent
    return path


def write_token(run_dir: str) -> str:
    """Rank 0: a token file the other nodes look for; its path. A directory rank 0 cannot write
    is reported by the `run dir` line (os.access), so a failed write only leaves nothing to find."""
    path = probe_dir_of(run_dir) / f"{TOKEN_PREFIX}{secrets.token_hex(8)}"
    with contextlib.suppress(OSError):
        path.write_text(path.name, encoding="ascii")
    return str(path)


def node_facts(*, name: str, address: str, nproc: int, device: str, iface_given: str | None, run_dir: str,
               token_path: str, head: bool) -> NodeFacts:
    """This node's facts. Disk is measured where the run directory (or its nearest existing parent)
    is on this node; the token is looked for at rank 0's path, which a shared mount also has."""
    probe = probe_dir_of(run_dir)
    iface = hardware.interface_holding(address)
    gpus, no_peer = gpu_facts() if device == "cuda" else ([], [])
    return NodeFacts(
        name=name, hostname=socket.gethostname(), versions=versions(), nproc=nproc, device=device, gpus=gpus,
        no_peer_access=no_peer, nvlink=device == "cuda" and len(gpus) > 1 and hardware.gpus_joined_by_nvlink(),
        address=address, iface=iface, iface_given=iface_given, nic_speed_mbit=hardware.nic_speed_mbit(iface),
        probe_dir=str(probe), writable=os.access(probe, os.W_OK), sees_token=None if head else Path(token_path).is_file(),
        free_disk_bytes=shutil.disk_usage(probe).free, host_ram_bytes=hardware.detect().host_ram_bytes,
        available_ram_bytes=host.available_ram_bytes(),
        cpu_gflops_per_core=round(hardware.measure_cpu_matmul_gflops(), 1) if device == "cpu" else None,
    )


# ------------------------------------------------------------------------------------------------
# under torchrun: timing


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: float, group, device) -> float:
    """The slowest rank's time: every rank then takes the same decisions (and the link is as fast as
    its slowest direction)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value.item())


def time_op(op: str, nbytes: int, *, group, ranks: int, device) -> float:
    """Seconds of one `op` of `nbytes` per rank, the slowest rank's: the fastest of the ops timed over
    ~TIME_PER_SIZE_S, at least MIN_TIMED of them. A link's capacity is its best case (other traffic,
    a descheduled process or a CPU another process holds only slow an op down): timed once, a 4 MiB
    all-reduce on a 50 Mbit/s shaped link read 38 Mbit/s in one run of test_doctor_cluster on the
    2-core test machine."""
    import torch
    import torch.distributed as dist

    # torch 2.13 renamed all_gather_into_tensor (deprecated) to all_gather_single
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    tensor = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    out = torch.zeros(tensor.numel() * ranks, dtype=torch.float32, device=device) if op == "all_gather" else None

    def once() -> None:
        if op == "all_reduce":
            dist.all_reduce(tensor, group=group)
        else:
            gather(out, tensor, group=group)

    # The first operation only sizes the loop: it opens a group's connections (NCCL builds its
    # rings), and TCP restarts its congestion window after an idle pause (tcp_slow_start_after_idle),
    # which made a lone 1 MiB all-gather on a 50 Mbit/s link read 32 instead of 46 Mbit/s.
    start = time.perf_counter()
    once()
    _sync(device)
    first = _slowest(time.perf_counter() - start, group, device)
    repeats = max(MIN_TIMED, min(MAX_REPEATS, int(TIME_PER_SIZE_S / max(first, 1e-6))))
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        _sync(device)
        fastest = min(fastest, time.perf_counter() - start)
    return _slowest(fastest, group, device)


def time_link(group, *, scope: str, where: str, ranks: int, device, backend: str) -> LinkResult:
    timings = []
    for op in ("all_reduce", "all_gather"):
        for nbytes in SIZES_BYTES:
            seconds = time_op(op, nbytes, group=group, ranks=ranks, device=device)
            timings.append(Timing(op=op, nbytes=nbytes, seconds=seconds, ranks=ranks))
            if seconds >= LONG_ENOUGH_S:
                break
    return LinkResult(scope=scope, where=where, ranks=ranks, backend=backend, timings=tuple(timings))


# ------------------------------------------------------------------------------------------------
# under torchrun: the whole check


@dataclass(frozen=True)
class Outcome:
    code: int
    table: str | None = None
    """Rank 0 only: the table to print."""
    written: str | None = None
    """Rank 0 only: the cluster file written (--out)."""
    error: str | None = None
    """Rank 0 only: why --out could not be written (after the table, which still prints)."""


def run_rank(*, recipe_path: str | None, overrides: list[str], iface: str | None, run_dir: str | None,
             out: str | None, join_timeout_s: float) -> Outcome:
    """One rank of `homelab-ft doctor` under torchrun. Every rank returns the same exit code."""
    import torch
    import torch.distributed as dist

    from homelab_ft.distributed import comm
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    address = local_address()
    if iface and iface not in [n for _, n in socket.if_nameindex()]:
        names = ", ".join(n for _, n in socket.if_nameindex())
        raise UserError(f"node {address} ({socket.gethostname()}): --iface {iface} does not exist there (it has "
                        f"{names}); pass the LAN interface's name (the same on every node)" if local_rank == 0 else "")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda" and local_world > torch.cuda.device_count():
        raise UserError(f"node {address}: {local_world} processes per node but {torch.cuda.device_count()} GPU(s); "
                        "pass --nproc-per-node with the GPU count" if local_rank == 0 else "")
    recipe = _load(recipe_path, overrides) if recipe_path else None
    run_dir = run_dir or (str(recipe.run_dir) if recipe else "runs")
    env = comm.setup(device_pref=device_type, timeout_s=join_timeout_s)
    if not env.distributed:
        raise UserError("homelab-ft doctor runs under torchrun; start it as `homelab-ft doctor`")
    token = [write_token(run_dir) if env.is_main else None]
    dist.broadcast_object_list(token, src=0)
    token_path = token[0]
    name = address if env.num_nodes > 1 else socket.gethostname()
    facts = None
    if local_rank == 0:
        facts = node_facts(name=name, address=address, nproc=local_world, device=device_type, iface_given=iface,
                           run_dir=run_dir, token_path=token_path, head=env.is_main)
    gathered: list = [None] * env.world_size
    dist.all_gather_object(gathered, dataclasses.asdict(facts) if facts else None)
    nodes = [NodeFacts(**f) for f in gathered if f is not None]
    if env.is_main:
        Path(token_path).unlink(missing_ok=True)
    log.info("%d ranks on %d node(s) joined over %s; timing collectives (a few seconds per link)",
             env.world_size, env.num_nodes, env.backend)
    links = _time_links(env, nodes, local_rank=local_rank, local_world=local_world)
    stage_links = doctor_p2p.check(env, recipe, nodes, local_world=local_world)  # a pipelined recipe's boundaries
    outcome = Outcome(code=0)
    if env.is_main:
        outcome = _report(nodes, links, recipe=recipe, recipe_path=recipe_path, out=out, stage_links=stage_links)
        if outcome.error:
            outcome = dataclasses.replace(outcome, code=2)
    code = [outcome.code]
    dist.broadcast_object_list(code, src=0)
    comm.teardown(env)
    return dataclasses.replace(outcome, code=code[0])


def _load(recipe_path: str, overrides: list[str]):
    from homelab_ft.recipe.config import load_recipe

    return load_recipe(recipe_path, overrides)


def _time_links(env, nodes: list[NodeFacts], *, local_rank: int, local_world: int) -> list[LinkResult]:
    """Between nodes (local rank 0 of each), then inside every node at once; gathered on rank 0.
    Every rank creates every group, in the same order, as torch.distributed requires."""
    import torch.distributed as dist

    backend = env.backend
    heads = [n * local_world for n in range(env.num_nodes)]
    between = dist.new_group(heads) if env.num_nodes > 1 else None
    inside = ([dist.new_group(list(range(n * local_world, (n + 1) * local_world))) for n in range(env.num_nodes)]
              if local_world > 1 else None)
    mine: list[dict] = []
    if between is not None and local_rank == 0:
        link = time_link(between, scope="inter-node", where=" <-> ".join(n.name for n in nodes), ranks=len(heads),
                         device=env.device, backend=backend)
        if env.is_main:
            mine.append(dataclasses.asdict(link))
    if inside is not None:
        node = env.rank // local_world
        link = time_link(inside[node], scope="intra-node", where=nodes[node].name, ranks=local_world,
                         device=env.device, backend=backend)
        if local_rank == 0:
            mine.append(dataclasses.asdict(link))
    gathered: list = [None] * env.world_size
    dist.all_gather_object(gathered, mine)
    links = []
    for per_rank in gathered:
        for data in per_rank:
            data["timings"] = tuple(Timing(**t) for t in data["timings"])
            links.append(LinkResult(**data))
    return links


def _report(nodes: list[NodeFacts], links: list[LinkResult], *, recipe, recipe_path: str | None,
            out: str | None, stage_links: tuple = ()) -> Outcome:
    from homelab_ft.cluster import clusterfile
    from homelab_ft.cluster.doctor import report as doctor_report

    values = doctor_report.cluster_values(nodes, links)
    wants_cuda = cuda_key(recipe) if recipe is not None else None
    on_cpu = wants_cuda is not None and values["device"] != "cuda"
    # a CUDA recipe on CPU-only ranks FAILs on its device line; planning it for the CPU would mislead
    needs = plan_needs(recipe, values, label=recipe_path) if recipe is not None and not on_cpu else None
    lines = doctor_report.all_lines(nodes, links, needs=needs, wants_cuda=wants_cuda,
                                    assumed_gbit=recipe.cluster.inter_link_gbit if recipe is not None else None)
    lines += doctor_p2p.report_lines(stage_links, nodes)
    device = "NCCL (CUDA)" if nodes[0].device == "cuda" else "gloo (CPU)"
    title = (f"homelab-ft doctor: {len(nodes)} node(s) x {values['gpus_per_node']} process(es), {device}"
             + (f", recipe {recipe_path}" if recipe_path else ""))
    table = doctor_report.format_table(lines, title=title)
    if out:
        measured = {"nodes": [dataclasses.asdict(n) for n in nodes], "links": [link.to_dict() for link in links],
                    "verdicts": [dataclasses.asdict(line) for line in lines]}
        header = (f"written by `homelab-ft doctor` at {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: `cluster:` is what "
                  "`homelab-ft plan/train --cluster` read; `measured:` is the record behind it")
        try:
            clusterfile.write(out, cluster=values, measured=measured, header=header)
        except OSError as err:
            return Outcome(code=2, table=table, error=f"--out {out}: cannot write it ({err.strerror}); choose a "
                                                      "path this user can write on the head node")
    return Outcome(code=doctor_report.exit_code(lines), table=table, written=out)


def cuda_key(recipe) -> str | None:
    """The recipe key that asks for CUDA (`train.device=cuda` or `cluster.device=cuda`), or None."""
    if recipe.train.device == "cuda":
        return "train.device=cuda"
    if recipe.cluster.device == "cuda":
        return "cluster.device=cuda"
    return None


def plan_needs(recipe, values: dict, *, label: str) -> Needs:
    """What `plan` needs per node for the recipe on this cluster: the measured RAM, GPUs and links
    replace the recipe's guesses (as `--cluster` does); nodes and processes stay the recipe's.
    `label` names the recipe in the table."""
    from homelab_ft.plan.planner import plan_for_recipe
    from homelab_ft.recipe.config import recipe_from_dict
    from homelab_ft.recipe.io import recipe_to_dict

    mine = (values["nodes"], values["gpus_per_node"])
    wanted = (recipe.cluster.nodes, recipe.cluster.gpus_per_node)
    if mine != wanted:
        return Needs(recipe=label, option=None,
                     problem=(f"the recipe runs {wanted[0]} node(s) x {wanted[1]} process(es), this check ran "
                              f"{mine[0]} x {mine[1]}; set cluster.nodes={mine[0]} cluster.gpus_per_node={mine[1]} "
                              "or check with the recipe's layout (--hosts, --nproc-per-node)"))
    measured = [f"cluster.{k}={json.dumps(v)}" for k, v in values.items() if k not in ("nodes", "gpus_per_node")]
    try:
        plan = plan_for_recipe(recipe_from_dict(recipe_to_dict(recipe), overrides=measured, source=label))
    except UserError as err:
        return Needs(recipe=label, option=None, problem=str(err))
    if plan.chosen is None:
        return Needs(recipe=label, option=None)
    return Needs(recipe=label, option=plan.chosen.label, host_ram_bytes=plan.chosen.host_bytes,
                 disk_bytes=(recipe.train.keep_last + 1) * (plan.checkpoint_bytes or 0))
