"""model/moe_experts.py on tiny random MoE models (Qwen3-MoE, Mixtral, gpt-oss): 4-bit experts
against the dequantized reference, adapters on experts against plain PyTorch, gradients included."""

from __future__ import annotations

import copy

import pytest
import torch
from families import tiny_config
from torch.func import functional_call

from homelab_ft.model import moe_experts

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")


def _model(model_type: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32).eval()
    for module in moe_experts.fused_experts(model).values():  # transformers initialises experts to ~0.02 std
        for name in moe_experts.projections(module):
            getattr(module, name).data.normal_(0, 0.2)
    return model


def _batch():
    torch.manual_seed(1)
    return torch.randint(3, 320, (2, 12))


def test_finds_the_expert_stacks_from_transformers_own_marks():
    from transformers import AutoModelForCausalLM

    for model_type in FAMILIES:
        model = _model(model_type)
        found = moe_experts.fused_experts(model)
        assert found and all(name.endswith(".experts") for name in found), (model_type, list(found))
    dense = AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert moe_experts.fused_experts(dense) == {}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_4bit_experts_equal_the_dequantized_reference(model_type):
    import bitsandbytes.functional as bnbf

    model = _model(model_type)
    original = {n: {p: getattr(m, p).detach().clone() for p in moe_experts.projections(m)}
                for n, m in moe_experts.fused_experts(model).items()}
    reference = copy.deepcopy(model)
    for name, module in moe_experts.fused_experts(model).items():
        moe_experts.quantize(module)
        twin = reference.get_submodule(name)
        for proj in moe_experts.projections(module):
            weight = original[name][proj]
            for e in range(weight.shape[0]):
                # the packed bytes are bitsandbytes' own for that expert's [out, in] matrix
                matrix = weight[e].t() if module.is_transposed else weight[e]
                q, _ = bnbf.quantize_4bit(matrix.contiguous(), blocksize=moe_experts.BLOCKSIZE, compress_statistics=True,
                                          quant_type="nf4")
                assert torch.equal(getattr(module, f"{proj}_4bit")[e], q)
                getattr(twin, proj).data[e] = moe_experts.dequantized(module, proj, e)
        assert not any(isinstance(p, torch.nn.Parameter) and p.dim() == 3 and p.dtype.is_floating_point
                       for p in module.parameters(recurse=False) if not p.dtype == torch.uint8)
    ids = _batch()
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert (got - want).abs().max().item() <= 1e-5
    assert (want - _model(model_type)(ids).logits).abs().max().item() > 1e-4  # 4-bit did change the weights


@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_4bit_expert_projection_equals_the_dequantized_matmul_exactly(model_type):
    """Per expert and projection, the packed forward is bit for bit the matmul on that expert's
    dequantized weight (the whole-model check above allows 1e-5 for the order of the sums)."""
    model = _model(model_type)
    torch.manual_seed(2)
    for module in moe_experts.fused_experts(model).values():
        moe_experts.quantize(module)
        for proj in moe_experts.projections(module):
            for e in (0, moe_experts._io(module, proj)[0] - 1):
                weight = moe_experts.dequantized(module, proj, e)
                x = torch.randn(5, weight.shape[0] if module.is_transposed else weight.shape[1])
                want = x @ weight if module.is_transposed else torch.nn.functional.linear(x, weight)
                if module.has_bias:
                    want = want + getattr(module, f"{proj}_bias")[e]
                assert torch.equal(moe_experts._project(module, proj, e, x), want), (model_type, proj, e)


def _reference_loss(model, adapters: dict, ids) -> torch.Tensor:
    """Plain PyTorch: the model's own experts forward on W + scaling * B @ A, per expert."""
    replaced = {}
    for name, module in moe_experts.fused_experts(model).items():
        for proj in moe_experts.projections(module):
            a, b, scaling = adapters[(name, proj)]
            delta = torch.einsum("eor,eri->eoi", b, a) * scaling  # [E, out, in]
            base = moe_experts.dequantized_stack(module, proj)
            replaced[f"{name}.{proj}"] = base + (delta.transpose(1, 2) if module.is_transposed else delta)
    return functional_call(model, replaced, (ids,), {"labels": ids}).loss


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16-base", "4bit-base"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_expert_adapters_forward_and_gradients_equal_plain_pytorch(model_type, quantized):
    model = _model(model_type)
    model.requires_grad_(False)  # the base is frozen, as every adapter rung builds it
    reference = copy.deepcopy(model)
    adapters = {}
    for name, module in moe_experts.fused_experts(model).items():
        if quantized:
            moe_experts.quantize(module)
        moe_experts.attach_lora(module, r=4, alpha=8.0, dropout=0.0)
        twin = reference.get_submodule(name)
        for proj in moe_experts.projections(module):
            lora = module.expert_lora[proj]
            lora.lora_B.data.normal_(0, 0.1)  # as after some training: A's gradient is not zero
            adapters[(name, proj)] = (lora.lora_A.detach().clone().requires_grad_(),
                                      lora.lora_B.detach().clone().requires_grad_(), lora.scaling)
            if quantized:
                for e in range(lora.lora_A.shape[0]):
                    getattr(twin, proj).data[e] = moe_experts.dequantized(module, proj, e)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".expert_lora." in n for n in trained)
    ids = _batch()
    loss = model(ids, labels=ids).loss
    loss.backward()
    for p in reference.parameters():
        p.requires_grad_(False)
    want = _reference_loss(reference, adapters, ids)
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-5
    for (name, proj), (a, b, _) in adapters.items():
        lora = model.get_submodule(name).expert_lora[proj]
        assert (lora.lora_A.grad - a.grad).abs().max().item() <= 1e-5
        assert (lora.lora_B.grad - b.grad).abs().max().item() <= 1e-5
        assert a.grad.abs().max().item() > 0 and b.grad.abs().max().item() > 0


def test_lora_starts_at_the_base_model():
    """Bit for bit against the same loop without adapters (its sums are ordered unlike
    transformers' own forward, which the loop equals within 1e-5: the test below)."""
    model = _model("qwen3_moe")
    ids = _batch()
    with torch.no_grad():
        for module in moe_experts.fused_experts(model).values():
            moe_experts._install_forward(module)
        before = model(ids).logits
        for module in moe_experts.fused_experts(model).values():
            moe_experts.attach_lora(module, r=4, alpha=8.0, dropout=0.1)
        after = model(ids).logits
    assert torch.equal(before, after)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_per_expert_fill_equals_quantize_after_load(model_type):
    """The fill of a meta-built packed stack (moe_experts.pack_meta + quantize_stack, as the loaders
    use from the checkpoint's stacked tensor) holds the bytes quantize-after-load holds, in uint8 and
    viewed as float storage (what FSDP2 shards), and the same forward."""
    model = _model(model_type)
    for storage in (torch.uint8, torch.float32):
        for name, module in moe_experts.fused_experts(copy.deepcopy(model)).items():
            weights = {p: getattr(module, p).detach().clone() for p in moe_experts.projections(module)}
            reference = copy.deepcopy(module)
            moe_experts.quantize(reference)
            with torch.device("meta"):
                moe_experts.pack_meta(module, quant_type="nf4", double_quant=True, storage_dtype=storage)
            for proj, weight in weights.items():
                assert getattr(module, f"{proj}_4bit").is_meta
                stack, states = moe_experts.quantize_stack(module, weight, name=proj, device="cpu")
                assert stack.dtype == storage and stack.shape[0] == weight.shape[0]
                assert torch.equal(stack.reshape(stack.shape[0], -1).view(torch.uint8),
                                   getattr(reference, f"{proj}_4bit").reshape(stack.shape[0], -1))
                setattr(module, f"{proj}_4bit", torch.nn.Parameter(stack, requires_grad=False))  # to_empty + copy
                moe_experts.set_states(module, proj, states)
            x = torch.randn(5, model.config.hidden_size)
            index = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [1, 3]])
            weights_k = torch.rand(5, 2)
            with torch.no_grad():
                assert torch.equal(module(x, index, weights_k), reference(x, index, weights_k)), (model_type, name)


@pytest.mark.parametrize("adapters", [False, True], ids=["plain", "adapters"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_expert_loop_gradients_to_the_input_and_routing_weights_equal_transformers(model_type, adapters):
    """moe_experts' loop (the shared gate/up lora_A, the routing weight on the down projection's
    input where scales_down_input says so, index_put_) against transformers' own experts forward
    on W + scaling * B @ A: output and the gradients of the hidden states and of the routing
    weights (they reach the router's input) within 1e-5 of the largest (fp32 sums in another
    order). Both routing-weight paths run: the tiny models' g but qwen3_moe's is wider than the
    hidden state, so without adapters the weight scales the output there."""
    module = next(iter(moe_experts.fused_experts(_model(model_type)).values()))
    module.requires_grad_(False)
    reference = copy.deepcopy(module)
    if adapters:
        moe_experts.attach_lora(module, r=4, alpha=8.0, dropout=0.0)
        for proj in moe_experts.projections(module):
            module.expert_lora[proj].lora_B.data.normal_(0, 0.1)
            for e in range(module.expert_lora[proj].lora_A.shape[0]):
                getattr(reference, proj).data[e] += moe_experts.merged_delta(module, proj, e).detach()
    else:
        moe_experts._install_forward(module)
    _, inner, out = moe_experts.expert_shape(module, "down_proj")
    assert moe_experts.scales_down_input(module, torch.float32) == (inner <= out or adapters)
    torch.manual_seed(2)
    tokens, top_k, experts = 24, 2, moe_experts.expert_shape(module, "down_proj")[0]
    index = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    grads = []
    for experts_module in (module, reference):
        torch.manual_seed(3)
        x = torch.randn(tokens, moe_experts.expert_shape(module, "down_proj")[2], requires_grad=True)
        weights = torch.rand(tokens, top_k, requires_grad=True)
        out = experts_module(x, index, weights)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append((out.detach(), x.grad, weights.grad))
    for got, want in zip(*grads, strict=True):
        assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item()), model_type
    assert grads[0][2].abs().max().item() > 0
