"""What a 4-bit base keeps where, priced against the bytes of a built tiny model (the trainer's own
meta build and per-block fill, train/build.py): the quantisation constants and one expert's
dequantized scratch stay whole on every rank's device, offloaded or sharded (they are module
attributes, not parameters FSDP2 shards or offloads), and the one-process MoE QLoRA load's host
temporaries count in the host peak."""

from __future__ import annotations

import json

import build_recipe
import pytest
import torch
from families import tiny_config

from homelab_ft.plan.inputs import Cluster
from homelab_ft.plan.ladder import option_rung
from homelab_ft.plan.planner import default_request
from homelab_ft.plan.price import params
from homelab_ft.plan.price.host_ram import CUDA_HOST_PROCESS_BYTES
from homelab_ft.plan.price.memory import estimate
from homelab_ft.plan.shape.shapes import model_shape
from homelab_ft.recipe.config import recipe_from_dict
from homelab_ft.rung import Rung

pytest.importorskip("bitsandbytes")


def _cluster(gpus: int) -> Cluster:
    return Cluster(device="cuda", nodes=1, gpus_per_node=gpus, device_bytes=24 << 30, host_ram_bytes=64 << 30,
                   inter_link_gbit=1.0, tflops=40.0)


# fp32 everywhere, as the CPU build below computes: the planner's figures in the same dtypes
REQUEST = default_request(method="qlora", quant={"bits": 4, "double_quant": True, "compute_dtype": "float32"}, model={"dtype": "float32"}, lora={"target_modules": ("all-linear",)}, train={"embedding_offload": False, "micro_batch_size": 1}, data={"max_length": 64})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(shape, the one-process 4-bit model as train/build.py makes it, the fill's peak) of a tiny
    qwen3_moe saved in bf16: meta build, to_empty, fill_from_safetensors on the CPU."""
    from transformers import AutoModelForCausalLM

    from homelab_ft.distributed import sharded_qlora
    from homelab_ft.train import build

    folder = tmp_path_factory.mktemp("qwen3_moe")
    config = tiny_config("qwen3_moe")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    recipe = recipe_from_dict(build_recipe.tiny_run(folder, method="qlora", rows=folder / "x.jsonl", lora=None, output=None,
                                                    train={"max_steps": None, "micro_batch_size": None}), source="test")
    rung = Rung("qlora", "no_shard", False)
    model = build._meta_architecture(recipe, config=build._config(recipe, model_dir=folder), rung=rung, dtype=torch.float32,
                                     storage_dtype=torch.uint8)
    model.to_empty(device="cpu")
    peak: dict = {}
    sharded_qlora.fill_from_safetensors(model, sharded_qlora.load_groups(model), folder,
                                        compute_device=torch.device("cpu"), peak=peak)
    shape = model_shape(json.loads((folder / "config.json").read_text()))
    return shape, model, peak, folder


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _state_tensors(state) -> list[torch.Tensor]:
    tensors = [state.absmax, state.code]
    if state.nested:
        tensors += [state.offset, state.state2.absmax, state.state2.code]
    return tensors


def _kept_bytes(model) -> tuple[int, int]:
    """(bytes of every QuantState tensor in the model, the largest one-expert dequantized weight)."""
    from homelab_ft.model import moe_experts, quant

    cls = quant.linear4bit_class()
    states = [m.quant_state for m in model.modules() if isinstance(m, cls)]
    scratch = 0
    for module in moe_experts.fused_experts(model).values():
        for name in moe_experts.projections(module):
            states += moe_experts.states(module, name)
            scratch = max(scratch, _nbytes(moe_experts.dequantized(module, name, 0)))
    unique = {t.data_ptr(): _nbytes(t) for s in states for t in _state_tensors(s)}
    assert len(unique) == sum(len(_state_tensors(s)) for s in states)  # no tensor shared between states
    return sum(unique.values()), scratch


def _estimate(shape, strategy: str, offload: bool, gpus: int):
    cluster = _cluster(gpus)
    rung = option_rung("qlora", strategy, offload, request=REQUEST, cluster=cluster, savers=(True, False))
    return estimate(shape, rung=rung, request=REQUEST, cluster=cluster)


def test_quant_constants_are_what_the_built_model_holds(built):
    shape, model, _, _ = built
    states, _ = _kept_bytes(model)
    assert params.quant_state_bytes(shape, REQUEST) == states


@pytest.mark.parametrize("gpus", [1, 2])
def test_offloaded_4bit_base_keeps_its_constants_and_scratch_on_the_device(built, gpus):
    """Before: `+offload` put 0 weight bytes on the device (FSDP2's CPUOffloadPolicy moves parameters
    only) and counted the constants in the offloaded host bytes."""
    shape, model, _, _ = built
    states, scratch = _kept_bytes(model)
    est = _estimate(shape, "full_shard", True, gpus)
    assert est.memory.weights == states + scratch
    # the host holds the offloaded rest, all ranks together: the parameters (packed bytes, fp32 ends,
    # adapters) once, and the adapters' fp32 gradients and two AdamW moments; beside every rank's
    # process and its fill's temporaries (the load, test_one_process_moe_qlora_host_peak_holds_the_load)
    param_bytes = sum(_nbytes(p) for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    per_rank = CUDA_HOST_PROCESS_BYTES + params.sharded_qlora_loading_bytes(shape, REQUEST, _cluster(gpus))
    assert est.host_bytes - gpus * per_rank == pytest.approx(param_bytes + 3 * 4 * trainable, abs=2 * gpus)


def test_sharded_4bit_base_splits_the_parameters_and_not_the_scratch(built):
    """Before: one expert's dequantized scratch was divided by the shard count with the weights."""
    shape, model, _, _ = built
    states, scratch = _kept_bytes(model)
    param_bytes = sum(_nbytes(p) for p in model.parameters())  # packed bytes, the fp32 ends and adapters
    two = _estimate(shape, "full_shard", False, 2)
    assert two.memory.weights == pytest.approx(param_bytes / 2 + states + scratch, abs=1)
    one = _estimate(shape, "no_shard", False, 1)
    assert one.memory.weights == param_bytes + states + scratch


def test_one_process_moe_qlora_host_peak_holds_the_load(built):
    """Before: the one-process MoE QLoRA load (meta build + per-block fill) priced 0 host bytes for
    the stacked experts it reads; now the host peak is the larger of the load and of training."""
    from homelab_ft.distributed.sharded_qlora import load_groups
    from homelab_ft.model import moe_experts
    from homelab_ft.model.checkpoint_keys import CheckpointKeys

    shape, model, peak, folder = built
    groups = load_groups(model)
    packed = {name for group in groups for name, module, attr in group if moe_experts.is_packed_stack(module, attr)}
    reads = dict(CheckpointKeys(model, folder).tensors([name for group in groups for name, _, _ in group]))
    stack = max(_nbytes(reads[name]) for name in packed)
    dense = max(_nbytes(t) for name, t in reads.items() if name not in packed)
    # the largest read: one projection's stacked experts held twice (the converter stacks gate and up),
    # or a dense tensor beside its fp32 copy
    loading = params.one_process_loading_bytes(shape, Rung("qlora", "no_shard", False), REQUEST, _cluster(1))
    assert loading == max(2 * stack, dense * (1 + 4 // 2))
    assert loading >= peak["temporaries"]  # what the fill itself held at once
    for gpus in (1, 2):  # DDP: every local rank loads its own copy
        est = _estimate(shape, "no_shard", False, gpus)
        assert est.host_bytes == gpus * (CUDA_HOST_PROCESS_BYTES + loading)


def test_fsdp_gathers_the_4bit_parameters_and_not_the_constants(built):
    """Before: a gathered 4-bit block (2 under full_shard, every block under shard_grad_op) counted
    its constants again, which every rank already keeps whole (0.45 GiB per rank on Qwen3-30B-A3B
    under shard_grad_op, 1.04 GiB on Llama-3.1-70B)."""
    from homelab_ft.model.blocks import transformer_blocks
    from homelab_ft.model.checkpoint_keys import is_adapter

    shape, model, _, _ = built
    blocks = [sum(_nbytes(p) for n, p in block.named_parameters() if not is_adapter(f".{n}"))
              for block in transformer_blocks(model)]
    ends = params.gathered_end_params(shape) * 4  # fp32 compute dtype
    assert _estimate(shape, "full_shard", False, 2).memory.gathered == ends + 2 * max(blocks)
    param_bytes = sum(_nbytes(p) for p in model.parameters())  # adapters included: gathered with their block
    resharded = (shape.root_params - params.gathered_end_params(shape)) * 4  # an untied embedding's
    assert _estimate(shape, "shard_grad_op", False, 2).memory.gathered == param_bytes - resharded
