"""The planner's MoE pieces against the model itself (issue 21): the fused expert stacks derive.py
reads, their 4-bit bytes (= moe_experts.packed_bytes after moe_experts.quantize), the adapters
`all-linear` puts on every expert (= what loading.attach_lora makes trainable), the bytes
moe_experts' expert loop keeps for backward (= saved-tensor hooks on a real CPU forward), and the
gradients alive when activation checkpointing recomputes the first block (= a real CPU backward)."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import pytest
import torch
from families import tiny_config

from homelab_ft.model import loading, moe_experts, quant
from homelab_ft.plan.planner import default_request
from homelab_ft.plan.price import params
from homelab_ft.plan.shape.shapes import model_shape
from homelab_ft.recipe.config import LoraConfig, QuantConfig
from homelab_ft.rung import Rung

pytest.importorskip("bitsandbytes")

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")
CPU = params.Cluster(device="cpu", nodes=1, gpus_per_node=1, device_bytes=16 << 30, host_ram_bytes=16 << 30,
                     inter_link_gbit=1.0, tflops=1.0)


def _shape_and_model(model_type: str):
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        shape = model_shape(json.loads((Path(folder) / "config.json").read_text()))
    torch.manual_seed(0)
    return shape, AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_planner_prices_4bit_experts_and_expert_adapters_as_built(model_type):
    shape, model = _shape_and_model(model_type)
    found = moe_experts.fused_experts(model)
    blocks = sum(b.num_blocks for b in shape.blocks if b.expert_stacks)
    assert blocks == len(found)
    # the adapters all-linear makes trainable: attention's through PEFT, every expert's through moe_experts
    request = default_request(method="qlora", lora={"r": 4, "target_modules": ("all-linear",)}, quant={"bits": 4, "double_quant": True})
    lora = loading.attach_lora(model, LoraConfig(r=4, alpha=8, dropout=0.0))
    trainable, _ = loading.count_params(lora)
    assert params.adapter_params(shape, request) == trainable
    expert_adapters = sum(p.numel() for n, p in lora.named_parameters() if ".expert_lora." in n)
    assert expert_adapters == sum(b.num_blocks * e * 4 * (i + o) for b in shape.blocks for e, i, o in b.expert_stacks)
    # the packed experts: moe_experts.packed_bytes of every module, after quantize
    packed = 0
    for module in found.values():
        moe_experts.quantize(module)
        packed += moe_experts.packed_bytes(module)
    without = dataclasses.replace(shape, blocks=tuple(dataclasses.replace(b, expert_stacks=()) for b in shape.blocks))
    with_experts, _ = params.base_weight_bytes(shape, Rung("qlora", "no_shard", False), request, CPU)
    plain, _ = params.base_weight_bytes(without, Rung("qlora", "no_shard", False), request, CPU)
    other = params.qlora_compute_bytes(request, CPU)
    expert_weights = sum(b.num_blocks * b.expert_weight_params for b in shape.blocks)
    codes = sum(b.num_blocks * e for b in shape.blocks for e, _, _ in b.expert_stacks) * params.quant_code_bytes(
        double_quant=True)  # each expert's QuantState has its own codes, which packed_bytes leaves out
    assert with_experts == plain - other * expert_weights + packed + codes


def test_qlora_refuses_8bit_experts_and_quantizes_4bit():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), dtype=torch.float32)
    with pytest.raises(quant.UserError, match="quant.bits=8"):
        quant.refuse_8bit_experts(model, QuantConfig(bits=8))
    assert quant.quantize_experts(model, QuantConfig()) == len(moe_experts.fused_experts(model)) > 0
    quant.raise_if_unquantizable(model)  # packed experts count as quantized


def test_shipped_qwen3_30b_a3b_recipe_plans_within_17_5_gib():
    """Issue 21's target: the shipped recipe (seq 2048, micro-batch 1, one 24 GB GPU) at <= 17.5 GiB
    per GPU, with adapters on every expert, the two offloads it forces priced as forced."""
    from homelab_ft.plan.planner import plan, recipe_shape, request_from_recipe
    from homelab_ft.recipe.config import load_recipe

    recipe = load_recipe(Path(__file__).parents[3] / "recipes" / "qwen3-30b-a3b-qlora-24gb.yaml")
    assert (recipe.data.max_length, recipe.train.micro_batch_size, recipe.lora.target_modules) == (2048, 1, "all-linear")
    shape, _ = recipe_shape(recipe)
    cuda = params.Cluster(device="cuda", nodes=1, gpus_per_node=1, device_bytes=24 << 30, host_ram_bytes=64 << 30)
    chosen = plan(shape, request=request_from_recipe(recipe), cluster=cuda).chosen
    assert chosen.rung.method == "qlora" and chosen.rung.activation_offload
    assert chosen.memory.total <= 17.5 * (1 << 30), chosen.memory.total / (1 << 30)
    assert params.host_embedding_bytes(shape, rung=chosen.rung, request=request_from_recipe(recipe),
                                       cluster=cuda) == 151936 * 2048 * 2
    assert chosen.trainable_params > sum(b.num_blocks * e * 4 * (i + o) for b in shape.blocks for e, i, o in b.expert_stacks)


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize(("model_type", "method", "dropout", "targets"), [
    *((m, "lora", 0.0, "all-linear") for m in FAMILIES), *((m, "qlora", 0.0, "all-linear") for m in FAMILIES),
    ("qwen3_moe", "lora", 0.1, "all-linear"), ("mixtral", "lora", 0.1, "all-linear"),
    ("qwen3_moe", "qlora", 0.0, ATTENTION), ("mixtral", "qlora", 0.0, ATTENTION)])
def test_planned_activations_equal_what_the_expert_loop_saves(model_type, method, dropout, targets):
    """The planner's bytes per token of each block (saved.py's frozen-base measurement of
    transformers' grouped_mm experts, the adapters' and activations.expert_loop_bytes) equal what
    saved-tensor hooks count on a real fp32 CPU forward through moe_experts' loop: 4-bit experts
    for QLoRA, adapters on every expert (or, QLoRA, on attention only). Both of the loop's
    routing-weight paths run: qwen3_moe's g is narrower than the hidden state (the weight scales
    the down input), mixtral's wider (its input with adapters reading g, its output otherwise).
    And the loop keeps no hidden-wide tensor per routed token (the old one kept three: the
    gathered input, the down output and index_add_'s source): beyond grouped_mm at most the shared
    input once per token and, per routed token, g and r-wide rows."""
    from homelab_ft.plan.price import activations
    from homelab_ft.plan.shape import saved
    from homelab_ft.plan.shape.derive import decoder_blocks

    shape, model = _shape_and_model(model_type)
    if method == "qlora":
        assert quant.quantize_experts(model, QuantConfig()) > 0
    lora_targets = (targets,) if isinstance(targets, str) else targets
    loading.attach_lora(model, LoraConfig(r=4, alpha=8, dropout=dropout,
                                          target_modules=targets if isinstance(targets, str) else list(targets)))
    model.get_input_embeddings().register_forward_hook(lambda module, args, output: output.requires_grad_())
    seq = 128
    torch.manual_seed(0)
    real = saved._saved_by_block(model, decoder_blocks(model), seq)
    request = default_request(method=method, lora={"r": 4, "dropout": dropout, "target_modules": lora_targets}, data={"max_length": seq}, train={"micro_batch_size": 1, "activation_checkpointing": False}, quant={"bits": 4})
    planned = activations._block_activation_bytes(shape, Rung(method, "no_shard", False), request, 4)
    for block, per_token in zip(shape.blocks, planned, strict=True):
        measured = real.get(block.first_layer, 0) / seq
        experts_dropped = 0
        if block.expert_stacks and "all-linear" in lora_targets:  # the gate/up input once, g per routed token
            experts_dropped = block.expert_stacks[0][1] + block.routed_experts * block.expert_stacks[-1][1]
        if dropout:  # the planner prices CUDA's fused dropout (a bool mask); ATen's CPU dropout keeps
            # its mask in the input's dtype (input * noise): 3 more bytes per dropped-out element
            inputs = sum(lin.in_features for lin in params.targeted_linears(block, request))
            measured -= 3 * (inputs + experts_dropped)
        assert abs(measured - per_token) <= 0.02 * per_token, (block.kind, measured, per_token)
        loop = measured - (per_token - activations.expert_loop_bytes(block, Rung(method, "no_shard", False), request, 4))
        if block.expert_stacks and not dropout:
            inner = block.expert_stacks[-1][1]
            assert loop <= (block.expert_stacks[0][1] + block.routed_experts * (inner + 3 * 4)) * 4, (block.kind, loop)


@pytest.mark.parametrize(("model_type", "method"), [("qwen3_moe", "lora"), ("llama", "lora"), ("llama", "full")])
def test_gradients_when_the_first_block_is_recomputed(model_type, method):
    """With activation checkpointing (the trainer's switch, blocks.enable_activation_checkpointing)
    the first block is recomputed last in backward: the gradients that exist at that moment, counted
    on a real CPU backward, are memory.Memory.gradients_at_recompute (for a full fine-tune beside the
    head's and final norm's, which gradients_in_backward holds)."""
    from homelab_ft.model.blocks import enable_activation_checkpointing
    from homelab_ft.plan.price import activations
    from homelab_ft.plan.shape.derive import decoder_blocks

    shape, model = _shape_and_model(model_type)
    if method == "lora":
        model = loading.attach_lora(model, LoraConfig(r=4, alpha=8, dropout=0.0))
    enable_activation_checkpointing(model)
    model.train()
    blocks = decoder_blocks(model.get_base_model() if method == "lora" else model)
    first, in_blocks = blocks[0], {id(p) for b in blocks for p in b.parameters()}
    in_backward, seen = [], []

    def at_recompute(module, args):  # transformers checkpoints the block's forward: its modules run again
        if in_backward and not seen:
            seen.append(sum(p.grad.numel() for p in model.parameters() if p.grad is not None and id(p) in in_blocks))

    for module in first.modules():
        module.register_forward_pre_hook(at_recompute)
    ids = torch.randint(0, shape.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    in_backward.append(True)
    loss.backward()
    request = default_request(method=method, lora={"r": 4, "dropout": 0.0, "target_modules": ("all-linear",)}, data={"max_length": 64}, train={"micro_batch_size": 1, "activation_checkpointing": True}, quant={"bits": 4})
    assert seen == [activations.gradients_at_recompute(
        shape, rung=Rung(method=method, strategy="no_shard", cpu_offload=False, activation_checkpointing=True),
        request=request, in_backward=False)] > [0]
