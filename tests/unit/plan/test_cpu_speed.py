"""A CPU plan's throughput and row lengths (issue 39 point 5: CPU plans ran ~5x slow): one core's
matmul rate measured once and cached, or given (cluster.cpu_gflops_per_core, which doctor writes),
and the step priced at the rows' measured padded width instead of data.max_length. Every figure is
injected: nothing here depends on how fast the machine running it is."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from homelab_ft.plan import hardware
from homelab_ft.plan.hardware import CPU_TFLOPS_PER_CORE, CPU_TRAINING_EFFICIENCY, Detected, resolve_cluster
from homelab_ft.plan.inputs import RowLengths
from homelab_ft.plan.planner import plan_for_recipe, request_from_recipe
from homelab_ft.plan.price.memory import GiB
from homelab_ft.plan.price.network import matmul_params
from homelab_ft.recipe.config import ClusterConfig, load_recipe
from homelab_ft.rules.loss_chunks import recomputes

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
CPU2 = Detected(gpu_count=0, gpu_name=None, vram_bytes=None, host_ram_bytes=24 * GiB, cpu_cores=2)

# `homelab-ft data inspect` of the demo recipes on this project's machine (data/lengths.py's histograms)
SFT_ROWS = RowLengths(counts=((70, 1), (71, 4), (72, 13), (73, 21), (74, 22), (75, 42), (76, 34), (77, 45), (78, 29),
                              (79, 37), (80, 16), (81, 30), (82, 13), (83, 6), (84, 3), (85, 3), (88, 1)))
GRPO_PROMPTS = RowLengths(counts=((42, 16), (43, 51), (44, 51), (45, 37), (46, 66), (47, 35)))


def cpu_cluster(gflops: float, *, cores: int = 2):
    return resolve_cluster(ClusterConfig(device="cpu"), detected=Detected(
        gpu_count=0, gpu_name=None, vram_bytes=None, host_ram_bytes=24 * GiB, cpu_cores=cores, cpu_gflops_per_core=gflops))


def test_a_measured_core_rate_prices_the_cpu_step_by_the_formula():
    """compute_s = 4 x matmul params x tokens (LoRA; + the chunked head's recompute) / (GFLOPS x
    efficiency x cores): here with rows that are all 80 tokens, so the padded width is 80."""
    recipe = load_recipe(RECIPES / "smollm2-lora-cpu.yaml")
    cluster = cpu_cluster(150.0)
    assert cluster.tflops == pytest.approx(150.0 * CPU_TRAINING_EFFICIENCY * 2 / 1000)
    plan = plan_for_recipe(recipe, cluster=cluster, lengths=RowLengths(counts=((80, 320),)))
    shape = plan.shape
    tokens = 80 * recipe.train.micro_batch_size
    flops = 4 * matmul_params(shape) * tokens
    if recomputes(recipe.train.loss_chunk_tokens, vocab_size=shape.vocab_size, tokens=tokens):
        flops += 2 * shape.vocab_size * shape.hidden_size * tokens
    assert plan.chosen.compute_s == pytest.approx(flops / (cluster.tflops * 1e12))
    assert "150 GFLOPS fp32 matmul per core (measured on this machine" in cluster.tflops_source


def test_a_given_rate_wins_and_nothing_measured_falls_back_to_the_default():
    given = resolve_cluster(ClusterConfig(device="cpu", cpu_gflops_per_core=90.0),
                            detected=dataclasses.replace(CPU2, cpu_gflops_per_core=150.0))
    assert given.tflops == pytest.approx(90.0 * CPU_TRAINING_EFFICIENCY * 2 / 1000)
    assert "(cluster.cpu_gflops_per_core)" in given.tflops_source
    default = resolve_cluster(ClusterConfig(device="cpu"), detected=CPU2)
    assert default.tflops == pytest.approx(CPU_TFLOPS_PER_CORE * 2)
    assert "nothing measured" in default.tflops_source


def test_train_num_threads_caps_the_cores_a_process_computes_on():
    """Each process runs train.num_threads threads (torch.set_num_threads, the nodes' OMP_NUM_THREADS):
    a rollout node's trainer on a 2-core node of its own with one thread computes on one core, as
    the same job's two processes on one 2-core machine do (bench/grpo_node.py --netns planned 2x too fast)."""
    one_thread = resolve_cluster(ClusterConfig(device="cpu", nodes=2), detected=dataclasses.replace(CPU2, cpu_gflops_per_core=150.0),
                                 num_threads=1)
    assert one_thread.tflops == pytest.approx(150.0 * CPU_TRAINING_EFFICIENCY / 1000)
    assert "x 1 core(s) per process" in one_thread.tflops_source
    shared = resolve_cluster(ClusterConfig(device="cpu", gpus_per_node=2), detected=dataclasses.replace(CPU2, cpu_gflops_per_core=150.0))
    assert shared.tflops == one_thread.tflops
    many = resolve_cluster(ClusterConfig(device="cpu"), detected=dataclasses.replace(CPU2, cpu_gflops_per_core=150.0),
                           num_threads=8)
    assert many.tflops == pytest.approx(150.0 * CPU_TRAINING_EFFICIENCY * 2 / 1000)  # no more cores than the node has
    recipe = load_recipe(RECIPES / "smollm2-lora-cpu.yaml", ["train.num_threads=1"])
    planned = plan_for_recipe(recipe, lengths=RowLengths(counts=((80, 320),)))
    assert "x 1 core(s) per process" in planned.cluster.tflops_source


def test_the_measurement_is_cached_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("HOMELAB_FT_CACHE", str(tmp_path))
    runs = []
    monkeypatch.setattr(hardware, "measure_cpu_matmul_gflops", lambda: runs.append(1) or 123.44)
    assert hardware.cpu_matmul_gflops() == 123.4  # measured, rounded, written
    assert json.loads(hardware.cpu_speed_path().read_text())["gflops_per_core"] == 123.4
    assert hardware.cpu_matmul_gflops() == 123.4 and len(runs) == 1  # read back, not measured again
    assert hardware.detect(cpu_speed=True).cpu_gflops_per_core == 123.4
    assert hardware.detect().cpu_gflops_per_core is None  # only asked for on a CPU plan
    hardware.cpu_speed_path().write_text("{not json")
    assert hardware.cpu_matmul_gflops() == 123.4 and len(runs) == 2  # an unreadable entry is measured again


def test_a_cpu_plan_reads_the_cached_rate(tmp_path, monkeypatch):
    monkeypatch.setenv("HOMELAB_FT_CACHE", str(tmp_path))
    monkeypatch.setattr(hardware, "measure_cpu_matmul_gflops", lambda: pytest.fail("measured although cached"))
    hardware.cpu_speed_path().parent.mkdir(parents=True)
    hardware.cpu_speed_path().write_text(json.dumps({"gflops_per_core": 77.0}))
    plan = plan_for_recipe(load_recipe(RECIPES / "smollm2-lora-cpu.yaml"))
    assert "77 GFLOPS fp32 matmul per core" in plan.cluster.tflops_source


def test_the_expected_longest_row():
    assert RowLengths(counts=((80, 10),)).expected_longest(8) == 80
    half = RowLengths(counts=((40, 1), (80, 1)))
    assert half.expected_longest(1) == pytest.approx(60)  # one row: the mean
    assert half.expected_longest(2) == pytest.approx(40 * 0.25 + 80 * 0.75)
    assert half.expected_longest(64) == pytest.approx(80, rel=1e-6)


def test_lengths_change_step_time_never_memory():
    """A batch may still hold a row at data.max_length: memory stays priced there."""
    recipe = load_recipe(RECIPES / "smollm2-dpo-cpu.yaml")
    cluster = cpu_cluster(150.0)
    at_max = plan_for_recipe(recipe, cluster=cluster)
    measured = plan_for_recipe(recipe, cluster=cluster, lengths=RowLengths(counts=((80, 160),)))
    assert measured.chosen.memory.total == at_max.chosen.memory.total
    assert measured.chosen.step_s == pytest.approx(at_max.chosen.step_s * 80 / 160)
    packed = request_from_recipe(load_recipe(RECIPES / "smollm2-lora-cpu.yaml", ["data.packing=true"]), lengths=SFT_ROWS)
    assert packed.timed_prompt_tokens == packed.data.max_length


# Measured on this project's 2-core AVX-512 Xeon, idle (load average < 0.2): one core's matmul
# 141 GFLOPS (hardware.cpu_matmul_gflops), smollm2-lora-cpu 1.91 / 2.22 / 2.12 s per step after the
# first (median 2.12); smollm2-grpo-cpu ~16 s per step (its recipe: ~6 s generating, ~10 s training).
MEASURED = [("smollm2-lora-cpu.yaml", SFT_ROWS, 2.12), ("smollm2-grpo-cpu.yaml", GRPO_PROMPTS, 16.0)]


@pytest.mark.parametrize("name,lengths,seconds", MEASURED)
def test_the_cpu_plan_is_within_a_quarter_of_the_measured_step(name, lengths, seconds):
    plan = plan_for_recipe(load_recipe(RECIPES / name), cluster=cpu_cluster(141.2), lengths=lengths)
    assert plan.chosen.step_s == pytest.approx(seconds, rel=0.25)
