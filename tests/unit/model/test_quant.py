"""QLoRA on a 4-bit (and 8-bit) bitsandbytes base, on CPU.

The central test compares LoRA gradients of the quantized model, after an eval pass without
gradients, with those of an fp32 model that holds the dequantized weights: the two compute the
same function, so the gradients must agree to fp32 rounding. "Loss goes down" would not catch the
bitsandbytes CPU repack bug (homelab_ft/model/quant.py): training still moves, just wrongly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from homelab_ft.errors import UserError
from homelab_ft.model import loading, quant
from homelab_ft.recipe.config import LoraConfig, ModelConfig, QuantConfig, TrainConfig, load_recipe
from homelab_ft.rung import Rung

bnb = pytest.importorskip("bitsandbytes")
from bitsandbytes.functional import dequantize_4bit, has_avx512bf16  # noqa: E402

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[3]
FP32_REL_TOL = 1e-5
"""Relative error of a whole gradient vector that fp32 rounding explains (measured: 0 exactly,
both sides run the same fp32 matmuls); the bug gives 0.30."""


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    from tiny import make_llama

    return make_llama(tmp_path_factory.mktemp("qlora-llama"), hidden_size=64, intermediate_size=128)


@pytest.fixture(scope="module")
def narrow_kv_dir(tmp_path_factory) -> Path:
    """k_proj/v_proj with 16 out-features: not a multiple of the CPU repack's 32-row blocks."""
    from tiny import make_llama

    return make_llama(tmp_path_factory.mktemp("narrow-kv"), hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=1)


def load_quantized(model_dir: Path, quant_cfg: QuantConfig, *, guard: bool = True):
    model = loading.load_model(
        ModelConfig(), model_dir,
        dtype=quant.compute_dtype(quant_cfg, device=CPU), device=CPU,
        quantization_config=quant.bnb_config(quant_cfg, device=CPU),
    )
    if guard:
        quant.after_load(model)
    return quant.prepare_for_training(model)


def dequantized_reference(model_dir: Path, quantized) -> torch.nn.Module:
    """fp32 model whose linear weights are exactly what the quantized layers compute with."""
    ref = loading.load_model(ModelConfig(), model_dir, dtype=torch.float32, device=CPU)
    layers = dict(quantized.named_modules())
    with torch.no_grad():
        for name, module in ref.named_modules():
            q = layers.get(name)
            if isinstance(q, bnb.nn.Linear4bit):
                module.weight.copy_(dequantize_4bit(q.weight.data, q.weight.quant_state).float())
            elif isinstance(q, bnb.nn.Linear8bitLt):
                # LLM.int8 stores round(W * 127 / rowmax) with rowmax in SCB
                module.weight.copy_(q.weight.data.float() * q.weight.SCB.float().unsqueeze(1) / 127)
    return ref


def with_lora(model, *, seed: int):
    """LoRA through the project's path, with seeded A and B (the same in both models). B is made
    non-zero: PEFT starts it at 0, which makes every A gradient 0 and would hide half the comparison."""
    model = loading.attach_lora(model, LoraConfig(r=8, alpha=16, dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


def lora_grads(model, input_ids) -> tuple[float, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad()
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys() and want
    num = sum(((got[k] - want[k]) ** 2).sum() for k in want) ** 0.5
    den = sum((want[k] ** 2).sum() for k in want) ** 0.5
    return (num / den).item()


def eval_pass(model, input_ids) -> None:
    """What an eval loop or `generate` does: eval mode, no grad. Triggers the CPU repack if unguarded."""
    model.eval()
    with torch.no_grad():
        model(input_ids=input_ids)


def grads_after_eval(model_dir: Path, quant_cfg: QuantConfig, *, guard: bool):
    """(relative gradient error after an eval pass, same before it) vs the dequantized fp32 model."""
    quantized = load_quantized(model_dir, quant_cfg, guard=guard)
    ref = with_lora(dequantized_reference(model_dir, quantized), seed=1)
    quantized = with_lora(quantized, seed=1)
    input_ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    _, want = lora_grads(ref, input_ids)
    _, before = lora_grads(quantized, input_ids)
    eval_pass(quantized, input_ids)
    _, after = lora_grads(quantized, input_ids)
    return rel_err(after, want), rel_err(before, want)


# --------------------------------------------------------------------------------------------
# the regression test


@pytest.mark.parametrize("quant_cfg", [
    QuantConfig(),  # nf4 + double quant: the default
    QuantConfig(quant_type="fp4", double_quant=False),
    QuantConfig(bits=8),
], ids=["nf4-dq", "fp4", "int8"])
def test_lora_grads_after_eval_match_dequantized_fp32(llama_dir, quant_cfg):
    after, before = grads_after_eval(llama_dir, quant_cfg, guard=True)
    assert before < FP32_REL_TOL
    assert after < FP32_REL_TOL


@pytest.mark.skipif(not has_avx512bf16(), reason="this CPU has no AVX512-BF16: bitsandbytes never repacks here, "
                    "so there is no unguarded failure to show (the guarded test above still checks the gradients)")
def test_without_the_guard_gradients_go_wrong_on_this_cpu(llama_dir):
    """Shows the guard is what makes the test above pass on AVX512-BF16 CPUs (measured: 0.30)."""
    after, before = grads_after_eval(llama_dir, QuantConfig(), guard=False)
    assert before < FP32_REL_TOL
    assert after > 0.05


def test_any_layer_shape_trains_with_the_guard(narrow_kv_dir):
    """16 k/v out-features: the unguarded repack asserts out_features % 32 == 0 (AssertionError on
    the first eval pass of an AVX512-BF16 CPU); guarded, no shape constraint is left."""
    after, _ = grads_after_eval(narrow_kv_dir, QuantConfig(), guard=True)
    assert after < FP32_REL_TOL


@pytest.mark.parametrize("double_quant", [True, False])
def test_4bit_model_saved_after_eval_reloads_unchanged(llama_dir, tmp_path, double_quant):
    quant_cfg = QuantConfig(double_quant=double_quant)
    model = load_quantized(llama_dir, quant_cfg)
    before = {n: dequantize_4bit(m.weight.data, m.weight.quant_state).clone()
              for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    eval_pass(model, torch.randint(0, 300, (1, 16)))
    model.save_pretrained(tmp_path)
    reloaded = loading.load_model(ModelConfig(), tmp_path, dtype=torch.float32, device=CPU)
    quant.after_load(reloaded)
    after = {n: dequantize_4bit(m.weight.data, m.weight.quant_state)
             for n, m in reloaded.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert after.keys() == before.keys() and before
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=name)


# --------------------------------------------------------------------------------------------
# loading


def test_4bit_load(llama_dir):
    model = load_quantized(llama_dir, QuantConfig())
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 7 * model.config.num_hidden_layers  # q k v o gate up down
    assert all(m.weight.quant_state.quant_type == "nf4" and m.weight.quant_state.nested for m in layers)
    assert all(m.compute_dtype == torch.float32 and not m.support_avx512bf16_for_cpu for m in layers)
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.float32
    assert not any(p.requires_grad for p in model.parameters())
    # the quantized model computes what the dequantized fp32 model computes
    ref = dequantized_reference(llama_dir, model)
    ids = torch.randint(0, 300, (2, 16))
    eval_pass(ref, ids)
    with torch.no_grad():
        model.eval()
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_8bit_load(llama_dir):
    model = load_quantized(llama_dir, QuantConfig(bits=8))
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    assert len(layers) == 7 * model.config.num_hidden_layers
    assert all(m.weight.dtype == torch.int8 for m in layers)
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())


def test_prepare_keeps_bf16_and_upcasts_fp16(llama_dir):
    bf16 = load_quantized(llama_dir, QuantConfig(compute_dtype="bfloat16"))
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    fp16 = load_quantized(llama_dir, QuantConfig(compute_dtype="float16"))
    floats = {p.dtype for p in fp16.parameters() if p.dtype.is_floating_point}
    assert floats == {torch.float32}


def test_bnb_config_fields():
    cfg = quant.bnb_config(QuantConfig(quant_type="fp4", double_quant=False), device=CPU)
    assert cfg.load_in_4bit and cfg.bnb_4bit_quant_type == "fp4" and not cfg.bnb_4bit_use_double_quant
    assert cfg.bnb_4bit_compute_dtype == torch.float32  # auto on CPU
    assert quant.bnb_config(QuantConfig(bits=8), device=CPU).load_in_8bit
    assert quant.compute_dtype(QuantConfig(compute_dtype="bfloat16"), device=CPU) == torch.bfloat16


# --------------------------------------------------------------------------------------------
# optimizers


@pytest.mark.parametrize("name", ["adamw_8bit", "paged_adamw_8bit"])
def test_8bit_adamw_tracks_torch_adamw(name):
    """Same lr, betas and decoupled weight decay as torch's AdamW, up to 8-bit moment rounding.

    Over 3 steps the update differs from torch's by 0.7% (relative norm, measured); a dropped
    weight decay (0.1 x lr x |w| is ~10% of each update here) or a wrong lr would exceed 3%."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(64, 128, generator=gen)
    grads = [torch.randn(64, 128, generator=gen) for _ in range(3)]
    cfg = TrainConfig(optimizer=name, lr=1e-3, weight_decay=0.1)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt = quant.make_optimizer([{"params": [ours], "weight_decay": cfg.weight_decay}], cfg)
    ref = torch.optim.AdamW([theirs], lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    for g in grads:
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert opt.state[ours]["state1"].dtype == torch.uint8  # 8-bit moments (8192 >= 4096 elements)
    want, got = (theirs - start).detach(), (ours - start).detach()
    assert ((got - want).norm() / want.norm()).item() < 0.03


def test_8bit_adamw_refuses_sharded_params():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        param = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]))
        with pytest.raises(UserError, match="adamw_8bit cannot update FSDP2-sharded"):
            quant.make_optimizer([{"params": [param]}], TrainConfig(optimizer="adamw_8bit"))
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# bad input


def test_bitsandbytes_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` raise
    with pytest.raises(UserError, match="method: qlora needs bitsandbytes.*method: lora"):
        quant.bnb_config(QuantConfig(), device=CPU)


def test_prequantized_checkpoint_refused(llama_dir):
    import json

    config = json.loads((llama_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(UserError, match="already quantized with gptq"):
        quant.check_quantizable(config, QuantConfig(), device=CPU)
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    with pytest.raises(UserError, match="quant.bits=8"):
        quant.check_quantizable(config, QuantConfig(bits=4), device=CPU)


def test_dense_model_is_quantizable(llama_dir):
    from transformers import AutoConfig

    quant.check_quantizable(AutoConfig.from_pretrained(llama_dir), QuantConfig(), device=CPU)


def test_fused_moe_experts_quantize_in_4_bits_only():
    """transformers 5 stores MoE experts as 3-D parameters, which bitsandbytes leaves in full precision;
    quant.quantize_experts packs them in 4 bits (moe_experts.py), so 4-bit QLoRA passes and 8-bit is refused."""
    from transformers import MixtralConfig

    config = MixtralConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    quant.check_quantizable(config.to_dict(), QuantConfig(), device=CPU)
    with pytest.raises(UserError, match=r"quant.bits=8: MoE experts are quantized in 4 bits only"):
        quant.check_quantizable(config.to_dict(), QuantConfig(bits=8), device=CPU)


def test_data_parallel_qlora_reduces_only_the_adapter(llama_dir):
    """`no_shard` wraps the QLoRA model in DDP over the LoRA parameters alone: the 4-bit base is
    never broadcast or all-reduced, so a step moves the adapter's gradients and nothing else."""
    import torch.distributed as dist

    from homelab_ft.distributed import comm, parallelize

    model = with_lora(load_quantized(llama_dir, QuantConfig()), seed=0)
    lora = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        env = comm.DistEnv(rank=0, local_rank=0, world_size=1, num_nodes=1, device=CPU, backend="gloo",
                                  is_main=True)
        ddp = parallelize.parallelize(model, env, rung=Rung("qlora", "no_shard", False))
        reduced = ddp._module_parameters  # what DDP's reducer buckets and all-reduces
        assert {id(p) for p in reduced} == lora
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# recipes


@pytest.mark.parametrize("name, nodes, strategy", [
    ("llama3-8b-qlora-24gb", 1, "auto"),
    ("qlora-2node-dp", 2, "no_shard"),
    ("smollm2-qlora-cpu", 1, "auto"),
])
def test_qlora_recipes_load(name, nodes, strategy):
    recipe = load_recipe(REPO / "recipes" / f"{name}.yaml")
    assert recipe.method == "qlora"
    assert recipe.cluster.nodes == nodes and recipe.sharding.strategy == strategy
