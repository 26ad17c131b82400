"""What this machine (or the cluster the user describes) has: the only module that probes.

`detect()` reads GPUs from `nvidia-smi` (not torch, so `homelab-ft plan` stays torch-free and
fast), host RAM from /proc/meminfo and the CPU count; asked for the CPU's speed, it reads the fp32
matmul rate of one core measured once per machine (`cpu_matmul_gflops`: cached under
locate.cache_root, the only time `plan` imports torch for it). `resolve_cluster()` is pure: it merges
the recipe's `cluster` section (which command-line flags have already overridden, see
`cluster_overrides`) with what was detected, into the planner's `Cluster`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from homelab_ft import fsio, host
from homelab_ft.errors import UserError
from homelab_ft.locate import cache_root
from homelab_ft.plan import gpus
from homelab_ft.plan.inputs import HOST_MEMORY_BYTES_PER_S, Cluster
from homelab_ft.plan.price.memory import GiB
from homelab_ft.recipe.config import ClusterConfig

log = logging.getLogger(__name__)

CPU_TFLOPS_PER_CORE = 0.02
"""Sustained training TFLOPS of one core when its matmul rate was neither measured nor given: an
older AVX2 core's (~30 GFLOPS fp32 matmul) at about two thirds. A core with AVX-512 measures 150-165
GFLOPS (this project's machine, `cpu_matmul_gflops`), so a plan priced with this is slow by ~5x
(issue 39); it is the floor for a machine that cannot measure, not the expected figure."""

CPU_TRAINING_EFFICIENCY = 0.55
"""The share of one core's measured fp32 matmul rate (`cpu_matmul_gflops`) a CPU training step
reaches per core, counting every FLOP network.compute_s prices: the rest goes to what that formula
leaves out (attention, norms, activations, the LoRA adapters' thin r=16 matmuls, AdamW, Python).
Measured with bench/cpu_plan_vs_measured.py on the CPU recipes (docs/ladder.md)."""

CPU_MATMUL_SHAPE = (1024, 576, 1536)
"""The timed matmul, [tokens x hidden] @ [hidden x intermediate]: SmolLM2's MLP over a micro-batch of
1,024 tokens, the CPU recipes' own shape (one thread reaches 150-165 GFLOPS on it and on the other
projections of those recipes, 128 on the LM head: measured on an AVX-512 Xeon)."""
CPU_MATMUL_TIME_S = 0.5


@dataclass(frozen=True)
class Detected:
    gpu_count: int
    gpu_name: str | None
    vram_bytes: int | None
    """Memory of the smallest detected GPU (the one that limits a plan)."""
    host_ram_bytes: int
    cpu_cores: int
    cpu_gflops_per_core: float | None = None
    """fp32 matmul GFLOPS of one core (`cpu_matmul_gflops`); None: not asked for."""


def detect(*, cpu_speed: bool = False) -> Detected:
    """Probe this machine: GPUs via nvidia-smi, RAM via /proc/meminfo, CPU count, and with `cpu_speed`
    one core's matmul rate (measured once per machine, cached) when no GPU is found."""
    names, vram = _nvidia_smi()
    return Detected(
        gpu_count=len(names),
        gpu_name=names[0] if names else None,
        vram_bytes=min(vram) if vram else None,
        host_ram_bytes=host.total_ram_bytes(),
        cpu_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
        cpu_gflops_per_core=cpu_matmul_gflops() if cpu_speed and not names else None,
    )


def cpu_speed_key() -> str:
    """What one core's matmul rate depends on: the CPU model (/proc/cpuinfo) and the installed torch
    (its oneDNN/MKL kernels), as the cache file's name."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    return hashlib.sha256(f"{model}\0{torch_version}".encode()).hexdigest()[:32]


def cpu_speed_path() -> Path:
    return cache_root() / "cpu_speed" / f"{cpu_speed_key()}.json"


def cpu_matmul_gflops() -> float | None:
    """One core's fp32 matmul GFLOPS: read from the cache, else measured (`measure_cpu_matmul_gflops`,
    about a second with torch's import) and cached; None when torch cannot run it."""
    path = cpu_speed_path()
    try:
        return float(json.loads(path.read_text())["gflops_per_core"])
    except FileNotFoundError:
        pass
    except (OSError, ValueError, TypeError, KeyError) as err:
        log.warning("ignoring the unreadable CPU speed %s (%s); measuring it again", path, err)
    try:
        gflops = round(measure_cpu_matmul_gflops(), 1)
    except (ImportError, RuntimeError) as err:
        log.warning("could not measure this CPU's matmul rate (%s); pricing CPU steps at %g GFLOPS per core",
                    err, CPU_TFLOPS_PER_CORE * 1000)
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fsio.replace_text(path, json.dumps({"gflops_per_core": gflops, "shape": list(CPU_MATMUL_SHAPE),
                                            "threads": 1}))
    except OSError as err:
        log.warning("could not cache the CPU speed in %s (%s); the next plan measures it again", path.parent, err)
    return gflops


def measure_cpu_matmul_gflops() -> float:
    """fp32 GFLOPS of a CPU_MATMUL_SHAPE matmul on one thread, best of the runs over CPU_MATMUL_TIME_S
    after two untimed ones (the threads torch had are restored). One thread: a per-core figure that
    another job on the other cores disturbs least; a process's figure is it x its cores."""
    import torch

    threads = torch.get_num_threads()
    m, k, n = CPU_MATMUL_SHAPE
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
        for _ in range(2):
            torch.matmul(a, b)
        best, spent = float("inf"), 0.0
        while spent < CPU_MATMUL_TIME_S:
            start = time.perf_counter()
            torch.matmul(a, b)
            seconds = time.perf_counter() - start
            best, spent = min(best, seconds), spent + seconds
    finally:
        torch.set_num_threads(threads)
    return 2 * m * k * n / best / 1e9


def _nvidia_smi() -> tuple[list[str], list[int]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [], []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return [], []
    names, vram = [], []
    for line in out.strip().splitlines():
        name, _, mib = line.rpartition(",")
        if name and mib.strip().isdigit():
            names.append(name.strip())
            vram.append(int(mib.strip()) * 1024**2)  # nvidia-smi reports MiB
    return names, vram


def cpu_cores_per_process(cores: int, processes: int) -> float:
    """Cores one CPU training process computes on: its whole share, or a fraction of one core
    when there are more processes than cores (the kernel time-slices them)."""
    if processes > cores:
        return max(1, cores) / processes
    return cores // processes


def resolve_cluster(cfg: ClusterConfig, *, detected: Detected, cluster_file: str | None = None,
                    num_threads: int | None = None) -> Cluster:
    """The recipe's cluster section, with what it leaves open filled from `detected`.
    `cluster_file`: the name of the `--cluster` file whose values the section holds, for the plan;
    `num_threads`: train.num_threads, the threads each CPU process computes with (torch.set_num_threads
    and the nodes' OMP_NUM_THREADS), which caps its cores: one thread on a node of 8 cores is one core."""
    device = cfg.device
    if device == "auto":
        device = "cuda" if cfg.vram_gib is not None or detected.gpu_count > 0 else "cpu"
    host = int(cfg.host_ram_gib * GiB) if cfg.host_ram_gib is not None else detected.host_ram_bytes
    source = "recipe/flags" if cfg.vram_gib is not None or cfg.host_ram_gib is not None else "detected"
    if cluster_file:
        source = f"cluster file {cluster_file}"
    links = _links(cfg)
    if device == "cpu":
        cores = cpu_cores_per_process(detected.cpu_cores, cfg.gpus_per_node)
        cores = min(cores, num_threads) if num_threads else cores
        tflops, tflops_source = cpu_throughput(cores, given=cfg.cpu_gflops_per_core, measured=detected.cpu_gflops_per_core)
        return Cluster(
            device="cpu", nodes=cfg.nodes, gpus_per_node=cfg.gpus_per_node,
            device_bytes=host // cfg.gpus_per_node, host_ram_bytes=host, intra_link=cfg.intra_link,
            inter_link_gbit=cfg.inter_link_gbit, tflops=tflops,
            memory_bytes_per_s=HOST_MEMORY_BYTES_PER_S / cfg.gpus_per_node,
            tflops_source=tflops_source, source=source, **links,
        )
    per_node = _node_vram_bytes(cfg)
    if per_node:
        vram, name = min(per_node), cfg.gpu_name
    elif cfg.vram_gib is not None:
        vram, name = int(cfg.vram_gib * GiB), cfg.gpu_name
    elif detected.vram_bytes is not None:
        vram, name = detected.vram_bytes, cfg.gpu_name or detected.gpu_name
    else:
        raise UserError(
            "cluster: no GPU detected on this machine and cluster.vram_gib is not set; describe the GPUs "
            "with --gpus 1x24GB (or cluster.vram_gib=24), or plan for the CPU with cluster.device=cpu"
        )
    speed = gpus.throughput(name, vram_bytes=vram, measured_tflops=cfg.gpu_tflops)
    return Cluster(
        device="cuda", nodes=cfg.nodes, gpus_per_node=cfg.gpus_per_node, device_bytes=vram,
        host_ram_bytes=host, intra_link=cfg.intra_link, inter_link_gbit=cfg.inter_link_gbit,
        tflops=speed.tflops, tflops_source=speed.source, memory_bytes_per_s=speed.bandwidth_bytes_per_s,
        source=source, **links,
        node_device_bytes=per_node if len(set(per_node)) > 1 else (),
    )


def cpu_throughput(cores: float, *, given: float | None, measured: float | None) -> tuple[float, str]:
    """(sustained TFLOPS of one CPU process, where the figure came from): one core's matmul GFLOPS
    from the recipe or cluster file (`cluster.cpu_gflops_per_core`, which `doctor` writes), else
    measured on this machine, x CPU_TRAINING_EFFICIENCY x the process's cores; CPU_TFLOPS_PER_CORE
    when neither is there."""
    per_process = f"x {cores:g} core(s) per process"
    for gflops, where in ((given, "cluster.cpu_gflops_per_core"), (measured, f"measured on this machine, {cpu_speed_path()}")):
        if gflops is not None:
            tflops = gflops * CPU_TRAINING_EFFICIENCY * cores / 1000
            return tflops, (f"CPU: {gflops:g} GFLOPS fp32 matmul per core ({where}) x {CPU_TRAINING_EFFICIENCY:g} "
                            f"reached in training (hardware.CPU_TRAINING_EFFICIENCY) {per_process} = {tflops:.3g} TFLOPS "
                            "sustained per process")
    return CPU_TFLOPS_PER_CORE * cores, (
        f"CPU: {CPU_TFLOPS_PER_CORE * 1000:g} GFLOPS per core (hardware.CPU_TFLOPS_PER_CORE: nothing measured; set "
        f"cluster.cpu_gflops_per_core or run `homelab-ft doctor`) {per_process} = {CPU_TFLOPS_PER_CORE * cores:.3g} "
        "TFLOPS sustained per process")


def _node_vram_bytes(cfg: ClusterConfig) -> tuple[int, ...]:
    """cluster.node_vram_gib in bytes, one per node (checked against cluster.nodes); () when unset."""
    if cfg.node_vram_gib is None:
        return ()
    if len(cfg.node_vram_gib) != cfg.nodes:
        raise UserError(f"cluster.node_vram_gib has {len(cfg.node_vram_gib)} entries for cluster.nodes={cfg.nodes}; "
                        "give one per node (e.g. --gpus 1x24GB,1x12GB sets both)")
    return tuple(int(v * GiB) for v in cfg.node_vram_gib)


def _links(cfg: ClusterConfig) -> dict:
    """The measured link keys of a cluster section as the planner's Cluster fields (ms -> s)."""
    ms = lambda value: None if value is None else value / 1000  # noqa: E731
    return dict(inter_link_measured=cfg.inter_link_measured, inter_latency_s=ms(cfg.inter_latency_ms),
                intra_link_gbit=cfg.intra_link_gbit, intra_latency_s=ms(cfg.intra_latency_ms))


# --------------------------------------------------------------------------------------------
# command-line cluster flags -> recipe overrides (pure)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNIT = {"": GiB, "k": 1024, "m": 1024**2, "g": GiB, "t": 1024**4}


def parse_size(text: str, *, flag: str) -> int:
    """'24GB', '24GiB', '24G', '24' (GiB), '512MB' -> bytes.

    GB is read as GiB on purpose: a "24 GB" card has 24 GiB (nvidia-smi: 24576 MiB), and RAM
    sticks are sold the same way.
    """
    match = _SIZE.match(text)
    if not match:
        raise UserError(f"{flag} {text!r}: not a size; write e.g. 24GB, 24GiB or 512MB")
    value = float(match.group(1)) * _UNIT[match.group(2).lower()]
    if value <= 0:
        raise UserError(f"{flag} {text!r}: the size must be greater than 0")
    return int(value)


def parse_gpu_nodes(text: str) -> list[tuple[int, int]]:
    """'2x24GB' -> [(2, bytes)]; '1x24GB,1x12GB' -> one (GPUs, bytes each) per node, first to last."""
    return [parse_gpus(part) for part in text.split(",")]


def parse_gpus(text: str) -> tuple[int, int]:
    """'2x24GB' -> (2 GPUs per node, bytes each)."""
    count, sep, size = text.lower().partition("x")
    if not sep or not count.strip().isdigit():
        raise UserError(f"--gpus {text!r}: write COUNTxSIZE per node, e.g. --gpus 2x24GB")
    if int(count) < 1:
        raise UserError(f"--gpus {text!r}: needs at least one GPU per node; for a CPU plan use cluster.device=cpu")
    return int(count), parse_size(size, flag="--gpus")


_LINK = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(g|m)(?:bit|bps|b|be)?(?:/s)?\s*$", re.IGNORECASE)


def parse_link(text: str) -> float:
    """'2.5Gbit', '10GbE', '1Gbps', '100Mbit' -> Gbit/s."""
    match = _LINK.match(text)
    if not match or float(match.group(1)) <= 0:
        raise UserError(f"--link {text!r}: write the Ethernet speed between nodes, e.g. 1Gbit, 2.5Gbit or 10GbE")
    value = float(match.group(1))
    return value if match.group(2).lower() == "g" else value / 1000


def cluster_overrides(*, gpus: str | None = None, nodes: int | None = None, link: str | None = None,
                      host_ram: str | None = None) -> list[str]:
    """`--gpus 2x24GB --nodes 2 --link 2.5Gbit --host-ram 64GB` as `cluster.key=value` overrides."""
    out = []
    if gpus is not None:
        out += _gpus_overrides(gpus, nodes=nodes)
    if nodes is not None:
        if nodes < 1:
            raise UserError(f"--nodes {nodes}: needs at least 1 node")
        out.append(f"cluster.nodes={nodes}")
    if link is not None:
        # a nominal speed replaces a measured one (a --cluster file's): collectives get ~90% of it
        out += [f"cluster.inter_link_gbit={parse_link(link)}", "cluster.inter_link_measured=false"]
    if host_ram is not None:
        out.append(f"cluster.host_ram_gib={parse_size(host_ram, flag='--host-ram') / GiB}")
    return out


def _gpus_overrides(gpus: str, *, nodes: int | None) -> list[str]:
    """`--gpus 2x24GB` (every node alike) or `--gpus 1x24GB,1x12GB` (one entry per node: sets
    cluster.nodes and cluster.node_vram_gib, the smallest as cluster.vram_gib)."""
    entries = parse_gpu_nodes(gpus)
    counts = {count for count, _ in entries}
    if len(counts) > 1:
        raise UserError(f"--gpus {gpus!r}: every node runs the same number of processes; give each node the same "
                        "GPU count (e.g. --gpus 1x24GB,1x12GB)")
    if len(entries) > 1 and nodes is not None and nodes != len(entries):
        raise UserError(f"--gpus {gpus!r} describes {len(entries)} nodes but --nodes {nodes}; drop --nodes or give "
                        "one --gpus entry per node")
    smallest = min(vram for _, vram in entries)
    out = ["cluster.device=cuda", f"cluster.gpus_per_node={counts.pop()}", f"cluster.vram_gib={smallest / GiB}"]
    if len(entries) == 1:
        return out + ["cluster.node_vram_gib=null"]
    sizes = ", ".join(f"{vram / GiB}" for _, vram in entries)
    return out + [f"cluster.nodes={len(entries)}", f"cluster.node_vram_gib=[{sizes}]"]


# --------------------------------------------------------------------------------------------
# network interfaces and GPU links (for `homelab-ft doctor`)

_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def interface_addresses() -> dict[str, list[str]]:
    """Each interface's addresses (IPv4 via the SIOCGIFADDR ioctl, IPv6 from /proc/net/if_inet6),
    without iproute2 or psutil. Linux; elsewhere only the names."""
    import fcntl
    import ipaddress
    import socket
    import struct

    found: dict[str, list[str]] = {name: [] for _, name in socket.if_nameindex()}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in found:
            try:
                raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            found[name].append(socket.inet_ntoa(raw[20:24]))
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as f:
            for line in f:
                words = line.split()
                if len(words) >= 6 and words[5] in found:
                    found[words[5]].append(str(ipaddress.IPv6Address(bytes.fromhex(words[0]))))
    except OSError:
        pass
    return found


def interface_holding(address: str) -> str | None:
    """The interface that has `address` (the local end of a connection), or None."""
    import ipaddress

    try:
        wanted = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    for name, addresses in interface_addresses().items():
        if any(ipaddress.ip_address(a) == wanted for a in addresses):
            return name
    return None


def nic_speed_mbit(iface: str | None) -> int | None:
    """The negotiated line rate from /sys/class/net/IF/speed (Mbit/s); None when the driver has none
    (loopback, Wi-Fi, some virtual NICs report -1 or refuse the read)."""
    if not iface:
        return None
    try:
        with open(f"/sys/class/net/{iface}/speed", encoding="ascii") as f:
            speed = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return speed if speed > 0 else None


def gpus_joined_by_nvlink() -> bool:
    """Whether `nvidia-smi topo -m` shows an NVLink (NV1, NV2 ...) between this node's GPUs."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return False
    try:
        out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return re.search(r"\bNV\d+\b", out) is not None
