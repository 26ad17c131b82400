"""The GPU table and the throughput the planner prices a step with (plan/gpus.py), and the line
of the plan that says which figure it used and where it came from (issue 24 item 2)."""

from __future__ import annotations

import re

import pytest

from homelab_ft.plan import gpus
from homelab_ft.plan.hardware import Detected, resolve_cluster
from homelab_ft.plan.price.memory import GiB
from homelab_ft.recipe.config import ClusterConfig

NOTHING = Detected(gpu_count=0, gpu_name=None, vram_bytes=None, host_ram_bytes=64 * GiB, cpu_cores=8)


@pytest.mark.parametrize("name,key", [
    ("NVIDIA GeForce RTX 4090", "RTX 4090"), ("NVIDIA GeForce RTX 4060 Ti", "RTX 4060 Ti"),
    ("NVIDIA GeForce RTX 4060", "RTX 4060"), ("NVIDIA GeForce RTX 4070 Ti SUPER", "RTX 4070 Ti SUPER"),
    ("NVIDIA GeForce RTX 2080 Ti", "RTX 2080 Ti"), ("NVIDIA GeForce RTX 3090 Ti", "RTX 3090 Ti"),
    ("NVIDIA GeForce RTX 5090", "RTX 5090"), ("NVIDIA RTX A6000", "RTX A6000"), ("NVIDIA RTX A4000", "RTX A4000"),
    ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada"), ("NVIDIA RTX 4000 SFF Ada Generation", "RTX 4000 SFF Ada"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "RTX PRO 6000"), ("NVIDIA L40S", "L40S"), ("NVIDIA L40", "L40"),
    ("NVIDIA L4", "L4"), ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA A10", "A10"), ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"), ("Tesla T4", "T4"), ("Tesla V100-SXM2-32GB", "V100"),
    ("AMD Radeon RX 7900 XTX", "RX 7900 XTX"), ("AMD Radeon RX 7900 XT", "RX 7900 XT"),
    ("AMD Radeon RX 9070 XT", "RX 9070 XT"), ("AMD Radeon RX 9070", "RX 9070"), ("AMD Radeon PRO W7900", "PRO W7900"),
    ("4060 Ti", "RTX 4060 Ti"),
])
def test_lookup_takes_the_longest_whole_word_match(name, key):
    assert gpus.lookup(name).key == key


def test_the_table_covers_the_cards_people_use_with_sane_figures():
    keys = {g.key for g in gpus.GPUS}
    for series in ("RTX 2080 Ti", "RTX 3090", "RTX 4090", "RTX 5090", "RTX A6000", "RTX 6000 Ada", "RX 7900 XTX",
                   "RX 9070 XT", "H100", "A100"):
        assert series in keys
    assert len(keys) == len(gpus.GPUS)
    families = set(re.findall(r"^  \[([a-z0-9-]+)\]", gpus.__doc__, re.MULTILINE))
    for g in gpus.GPUS:
        assert g.source in families, g  # every row cites a documented source
        assert 10 < g.tflops < 3000 and 100 < g.bandwidth_gbs < 10_000 and g.memory_gib > 0
    assert gpus.lookup("NVIDIA GeForce RTX 4090").tflops == 165.2  # dense: the Ada whitepaper's 330.4 is sparse


def test_an_unknown_gpu_is_priced_as_the_slowest_card_of_its_memory_not_100_tflops():
    """`--gpus 1x24GB` names no model; a 4060 Ti used to be unknown: both were priced at 100 TFLOPS."""
    for name, vram_gib, slowest in ((None, 24, "RTX 3090"), ("NVIDIA GeForce GTX 1080", 8, "RTX 3060"),
                                    ("Mystery 16GB", 16, "RTX 4060 Ti"), (None, 512, None)):
        speed = gpus.throughput(name, vram_bytes=vram_gib * GiB)
        expected = gpus.slowest_with(vram_gib * GiB)
        assert speed.tflops == expected.tflops * gpus.MFU
        assert slowest is None or (expected.key == slowest and expected.tflops < 100)
        assert f"priced as the table's slowest card with >= {vram_gib} GiB, {expected.key}" in speed.source
        assert "cluster.gpu_name" in speed.source and "homelab-ft doctor" in speed.source


def test_the_plan_says_which_throughput_it_used_and_where_from():
    flags = dict(device="cuda", vram_gib=16.0)
    unknown = resolve_cluster(ClusterConfig(**flags), detected=NOTHING)
    assert unknown.tflops == pytest.approx(44.2 * 0.4) and "no GPU model given" in unknown.tflops_source
    table = resolve_cluster(ClusterConfig(**flags, gpu_name="NVIDIA GeForce RTX 4060 Ti"), detected=NOTHING)
    assert table.tflops == pytest.approx(44.2 * 0.4)
    assert table.tflops_source.startswith("NVIDIA GeForce RTX 4060 Ti: 44.2 TFLOPS dense bf16, 288 GB/s (GPU table")
    measured = resolve_cluster(ClusterConfig(**flags, gpu_name="NVIDIA GeForce RTX 4060 Ti", gpu_tflops=40.0),
                               detected=NOTHING)
    assert measured.tflops == pytest.approx(16.0) and "measured by doctor (cluster.gpu_tflops)" in measured.tflops_source
    detected = Detected(gpu_count=1, gpu_name="NVIDIA GeForce RTX 4090", vram_bytes=24 * GiB, host_ram_bytes=64 * GiB,
                        cpu_cores=8)
    assert resolve_cluster(ClusterConfig(), detected=detected).tflops == pytest.approx(165.2 * 0.4)
    cpu = resolve_cluster(ClusterConfig(device="cpu"), detected=NOTHING)
    assert cpu.tflops_source.startswith("CPU: 20 GFLOPS per core")


def test_plan_text_has_the_compute_line(capsys):
    from pathlib import Path

    from homelab_ft.cli.main import main

    root = Path(__file__).resolve().parents[3]
    main(["plan", str(root / "recipes" / "llama3-8b-qlora-24gb.yaml"), "--gpus", "1x24GB"])
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("compute "))
    assert "RTX 3090 (71 TFLOPS dense bf16) x 0.4 MFU = 28.4 TFLOPS sustained per GPU" in line
