"""The model for a rung (train/build.py) on one process: the rung's dtypes decided once, activation
checkpointing switched on by the one function for every method, and the adapters of a QLoRA-style
reset drawn from the seed alone (what makes 1 process, DDP and FSDP start alike)."""

from __future__ import annotations

import pytest
import torch

from homelab_ft.distributed import comm
from homelab_ft.model import loading
from homelab_ft.plan.planner import recipe_shape
from homelab_ft.recipe.config import LoraConfig, ModelConfig, recipe_from_dict
from homelab_ft.rung import Rung, rung_for
from homelab_ft.train.build import build_model, dtypes_for

ENV = comm.DistEnv(0, 0, 1, 1, torch.device("cpu"), None, True)


def _recipe(method: str, **sections):
    return recipe_from_dict({"method": method, "model": {"path": "unused", "dtype": "float32"}, **sections})


@pytest.mark.parametrize(("method", "sharding", "want"), [
    ("lora", {}, (torch.float32, torch.float32, torch.float32)),
    ("full", {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}, (torch.float32, torch.bfloat16, torch.bfloat16)),
    # QLoRA's compute dtype is quant.compute_dtype (auto = fp32 on a CPU), not model.dtype
    ("qlora", {}, (torch.float32, torch.float32, torch.float32)),
])
def test_dtypes_for_the_rung(method, sharding, want):
    recipe = _recipe(method, sharding=sharding)
    dtypes = dtypes_for(recipe, rung=rung_for(recipe), device=torch.device("cpu"))
    assert (dtypes.compute, dtypes.param, dtypes.reduce) == want


def test_model_dtype_is_qloras_compute_only_when_not_quantized():
    recipe = _recipe("lora", model={"path": "unused", "dtype": "bfloat16"})
    assert dtypes_for(recipe, rung=rung_for(recipe), device=torch.device("cpu")).compute == torch.bfloat16
    recipe = _recipe("qlora", model={"path": "unused", "dtype": "bfloat16"}, quant={"compute_dtype": "float32"})
    rung = Rung("qlora", "no_shard", False)
    assert dtypes_for(recipe, rung=rung, device=torch.device("cpu")).compute == torch.float32


@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("checkpointing", [True, False])
def test_activation_checkpointing_on_every_block_or_none(tiny_model_dir, method, checkpointing):
    recipe = recipe_from_dict({"method": method, "model": {"path": str(tiny_model_dir), "dtype": "float32"},
                               "lora": {"r": 4}, "train": {"activation_checkpointing": checkpointing, "device": "cpu"}})
    model = build_model(recipe, model_dir=tiny_model_dir, facts=recipe_shape(recipe)[0].facts, rung=rung_for(recipe), env=ENV)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    assert [layer.gradient_checkpointing for layer in base.model.layers] == [checkpointing] * len(base.model.layers)
    assert base.is_activation_checkpointing == checkpointing


def test_reset_adapters_depends_on_the_seed_alone(tiny_model_dir):
    """However the global generator stood when PEFT built them, the reset adapters are equal, and
    the generator is left where it was."""
    cfg = ModelConfig(path=str(tiny_model_dir))
    adapters = []
    for draws in (0, 7):
        torch.manual_seed(123)
        torch.rand(draws)
        model = loading.attach_lora(loading.load_model(cfg, tiny_model_dir, dtype=torch.float32, device=torch.device("cpu")),
                                    LoraConfig(r=4, alpha=8))
        before = torch.get_rng_state()
        loading.reset_adapters(model, seed=5)
        assert torch.equal(torch.get_rng_state(), before)
        adapters.append({n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n})
    assert adapters[0].keys() == adapters[1].keys() and adapters[0]
    assert all(torch.equal(adapters[0][n], adapters[1][n]) for n in adapters[0])
    assert any(adapters[0][n].abs().sum() > 0 for n in adapters[0] if ".lora_A." in n)
