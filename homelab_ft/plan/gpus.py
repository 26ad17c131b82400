"""What a GPU computes: its dense 16-bit tensor throughput and memory bandwidth from the vendor's
specification, found by the name nvidia-smi (or torch on ROCm) prints, and the throughput the
planner prices a step with. Pure: no torch, no I/O.

`throughput()` says where its figure came from, and the plan prints that line: a matmul `doctor`
measured (`cluster.gpu_tflops`), the table below, or, for a GPU it cannot name, the slowest card
in the table with at least that much memory, named, so an unknown card is never priced faster
than what people buy with that much memory.

Figures are dense (no 2:4 sparsity) FP16/BF16 tensor TFLOPS with FP32 accumulation, which is
what torch's bf16 matmuls use; GeForce cards run that at half their FP16-accumulate rate, the
workstation and datacenter cards at full rate. Turing (RTX 20, Titan RTX, T4) and V100 have no
bf16: their FP16 figure is listed, the rate the fp16/fp32 training they fall back to gets.
Sources, per family:
  [turing]    NVIDIA Turing GPU Architecture whitepaper (2018), Appendix A tables (reference
              boost clocks, "Peak FP16 Tensor TFLOPS with FP32 Accumulate").
  [ampere]    NVIDIA Ampere GA102 GPU Architecture whitepaper v2.1 (2021), Appendix A; RTX 3060 /
              3060 Ti / 3070 Ti / 3080 Ti / 3090 Ti from nvidia.com's GeForce RTX 30 specifications
              (the same per-SM rate x boost clock).
  [ampere-pro] NVIDIA RTX A4000 / A4500 / A5000 / A6000 datasheets ("Tensor Performance", sparse,
              halved here) and the GA102 whitepaper's A6000 column; A10 / A40 datasheets.
  [ada]       NVIDIA Ada GPU Architecture whitepaper v2.1 (2023), Appendix A (RTX 4090, 4080, 4070 Ti,
              RTX 6000 Ada, L40, L4); the other GeForce 40 cards from nvidia.com's specifications
              (2 x their shader TFLOPS, the rate the whitepaper gives for AD10x GeForce).
  [ada-pro]   NVIDIA RTX 4000 SFF / 4000 / 4500 / 5000 / 6000 Ada Generation datasheets (FP8
              sparse "Tensor Performance" / 4 = FP16 dense); L40S datasheet (362 bf16 dense).
  [blackwell] NVIDIA RTX Blackwell GPU Architecture whitepaper (2025), Appendix A (RTX 5090, 5080,
              5070 Ti, 5070); RTX 5060 Ti / 5060 from nvidia.com's specifications (2 x shader
              TFLOPS); RTX PRO 6000 Blackwell datasheet (4 PFLOPS FP4 sparse / 8).
  [hopper]    NVIDIA H100 / H200 datasheets (bf16 dense: half the "with sparsity" figure);
              A100 datasheet (312); V100 and T4 datasheets; B200: DGX B200 datasheet per GPU.
  [rdna3]     AMD product pages, Radeon RX 7000 and Radeon PRO W7000 series ("Peak Half Precision
              (FP16) Performance", WMMA dense; RDNA 3 has no sparsity); bf16 runs at the same rate.
  [rdna4]     AMD product pages, Radeon RX 9000 series ("Peak Half Precision (FP16) Matrix
              Performance", dense, without the "with structured sparsity" doubling).
Bandwidths are the vendors' memory-bandwidth lines (GB/s) of the same pages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MFU = 0.4
"""Hugging Face training loops reach 30-50% model-FLOPs utilisation on one GPU (nanoGPT and
torchtitan MFU reports); 0.4 turns a peak figure into a sustained one."""


@dataclass(frozen=True)
class Gpu:
    key: str
    """Matched as a whole word, case-insensitively, in the device name; the longest match wins
    (`4060 Ti` before `4060`, `7900 XTX` before `7900 XT`)."""
    memory_gib: int
    """The usual memory size (the largest variant where there are several)."""
    tflops: float
    """Dense FP16/BF16 tensor TFLOPS with FP32 accumulation (module docstring)."""
    bandwidth_gbs: int
    source: str


def _family(source: str, *rows: tuple[str, int, float, int]) -> list[Gpu]:
    return [Gpu(key=key, memory_gib=mem, tflops=tflops, bandwidth_gbs=bw, source=source) for key, mem, tflops, bw in rows]


GPUS: tuple[Gpu, ...] = tuple(
    _family("turing", ("RTX 2060", 6, 25.8, 336), ("RTX 2060 SUPER", 8, 28.7, 448), ("RTX 2070", 8, 29.9, 448),
            ("RTX 2070 SUPER", 8, 36.3, 448), ("RTX 2080", 8, 40.3, 448), ("RTX 2080 SUPER", 8, 44.6, 496),
            ("RTX 2080 Ti", 11, 53.8, 616), ("TITAN RTX", 24, 130.5, 672))
    + _family("ampere", ("RTX 3060", 12, 25.6, 360), ("RTX 3060 Ti", 8, 32.4, 448), ("RTX 3070", 8, 40.6, 448),
              ("RTX 3070 Ti", 8, 43.5, 608), ("RTX 3080", 10, 59.5, 760), ("RTX 3080 Ti", 12, 68.2, 912),
              ("RTX 3090", 24, 71.0, 936), ("RTX 3090 Ti", 24, 80.0, 1008))
    + _family("ampere-pro", ("RTX A4000", 16, 76.7, 448), ("RTX A4500", 20, 94.6, 640), ("RTX A5000", 24, 111.1, 768),
              ("RTX A6000", 48, 154.8, 768), ("A10", 24, 125.0, 600), ("A40", 48, 149.7, 696))
    + _family("ada", ("RTX 4060", 8, 30.2, 272), ("RTX 4060 Ti", 16, 44.2, 288), ("RTX 4070", 12, 58.3, 504),
              ("RTX 4070 SUPER", 12, 71.0, 504), ("RTX 4070 Ti", 12, 80.2, 504), ("RTX 4070 Ti SUPER", 16, 88.2, 672),
              ("RTX 4080", 16, 97.5, 717), ("RTX 4080 SUPER", 16, 104.4, 736), ("RTX 4090", 24, 165.2, 1008),
              ("L4", 24, 121.0, 300), ("L40", 48, 181.0, 864))
    + _family("ada-pro", ("RTX 4000 SFF Ada", 20, 76.7, 280), ("RTX 4000 Ada", 20, 81.9, 360),
              ("RTX 4500 Ada", 24, 158.5, 432), ("RTX 5000 Ada", 32, 261.1, 576), ("RTX 6000 Ada", 48, 364.2, 960),
              ("L40S", 48, 362.0, 864))
    + _family("blackwell", ("RTX 5060", 8, 38.4, 448), ("RTX 5060 Ti", 16, 47.4, 448), ("RTX 5070", 12, 61.7, 672),
              ("RTX 5070 Ti", 16, 87.9, 896), ("RTX 5080", 16, 112.6, 960), ("RTX 5090", 32, 209.5, 1792),
              ("RTX PRO 6000", 96, 500.0, 1792))
    + _family("hopper", ("T4", 16, 65.0, 320), ("V100", 32, 125.0, 900), ("A100", 80, 312.0, 2039),
              ("H100 PCIe", 80, 756.0, 2000), ("H100", 80, 989.0, 3350), ("H200", 141, 989.0, 4800),
              ("B200", 180, 2250.0, 8000))
    + _family("rdna3", ("RX 7600", 8, 43.5, 288), ("RX 7600 XT", 16, 45.1, 288), ("RX 7700 XT", 12, 70.3, 432),
              ("RX 7800 XT", 16, 74.7, 624), ("RX 7900 GRE", 16, 92.0, 576), ("RX 7900 XT", 20, 103.0, 800),
              ("RX 7900 XTX", 24, 122.8, 960), ("PRO W7800", 32, 90.5, 576), ("PRO W7900", 48, 122.6, 864))
    + _family("rdna4", ("RX 9060 XT", 16, 102.6, 320), ("RX 9070", 16, 144.5, 640), ("RX 9070 XT", 16, 194.7, 640))
)


def _matches(key: str, name: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", name, re.IGNORECASE) is not None


def lookup(name: str | None) -> Gpu | None:
    """The table's row for a device name (nvidia-smi's `NVIDIA GeForce RTX 4090`, ROCm's `AMD
    Radeon RX 7900 XTX`, or just `4090`), or None. `RTX ` may be left out of the name given."""
    if not name:
        return None
    found = [g for g in GPUS if _matches(g.key, name) or _matches(g.key.removeprefix("RTX "), name)]
    return max(found, key=lambda g: len(g.key), default=None)


def slowest_with(vram_bytes: int) -> Gpu:
    """The slowest card in the table with at least `vram_bytes` of memory (a GiB of slack for what
    the driver keeps), or the largest cards' slowest when none has that much: what an unnamed GPU
    is priced as."""
    gib = vram_bytes / 2**30
    big_enough = [g for g in GPUS if g.memory_gib >= gib - 1] or [g for g in GPUS if g.memory_gib == max(x.memory_gib for x in GPUS)]
    return min(big_enough, key=lambda g: g.tflops)


@dataclass(frozen=True)
class Throughput:
    tflops: float
    """Sustained training TFLOPS the step time is priced with (peak x MFU)."""
    source: str
    """One line for the plan: which peak, from where, and the sustained figure it gives."""
    bandwidth_bytes_per_s: float = 0.0
    """Memory bandwidth (the table's line for the card, or for one it cannot name the card priced in
    its place), what a decode step streams the weights at (plan/price/rollout.py)."""


def throughput(name: str | None, *, vram_bytes: int, measured_tflops: float | None = None) -> Throughput:
    """The sustained TFLOPS of one GPU and where the figure came from: a measured matmul first
    (`doctor` writes `cluster.gpu_tflops`), else the table, else the slowest card of that memory."""
    label = name or "an unnamed GPU"
    gpu = lookup(name)
    bandwidth = (gpu or slowest_with(vram_bytes)).bandwidth_gbs * 1e9

    def sustained(peak: float) -> str:
        return f"x {MFU:g} MFU = {peak * MFU:.3g} TFLOPS sustained per GPU"

    if measured_tflops is not None:
        return Throughput(measured_tflops * MFU, f"{label}: {measured_tflops:g} TFLOPS bf16 matmul measured by "
                                                 f"doctor (cluster.gpu_tflops) {sustained(measured_tflops)}", bandwidth)
    if gpu is not None:
        return Throughput(gpu.tflops * MFU, f"{label}: {gpu.tflops:g} TFLOPS dense bf16, {gpu.bandwidth_gbs} GB/s "
                                            f"(GPU table: {gpu.key}, {gpu.source} specifications) {sustained(gpu.tflops)}",
                          bandwidth)
    slow = slowest_with(vram_bytes)
    why = f"{name!r} is not in the GPU table" if name else "no GPU model given"
    return Throughput(slow.tflops * MFU, f"{label}: {why}, so priced as the table's slowest card with "
                                         f">= {vram_bytes / 2**30:.0f} GiB, {slow.key} ({slow.tflops:g} TFLOPS dense bf16) "
                                         f"{sustained(slow.tflops)}; name it with cluster.gpu_name, or measure it "
                                         "with `homelab-ft doctor`", bandwidth)
