"""Where models come from: local dirs, cached hub ids, GGUF files; all offline."""

from __future__ import annotations

import shutil

import pytest
import torch

from homelab_ft.errors import UserError
from homelab_ft.model import loading
from homelab_ft.recipe.config import LoraConfig, ModelConfig


def test_local_dir_and_bad_paths(tmp_path, tiny_model_dir):
    assert loading.resolve_model_dir(str(tiny_model_dir)) == tiny_model_dir
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        loading.resolve_model_dir(str(tmp_path / "empty"))
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        loading.resolve_model_dir(str(tmp_path / "weights.bin"))


def test_hub_id_is_found_in_the_local_cache_only(tmp_path, tiny_model_dir, monkeypatch):
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / "0123abcd"
    shutil.copytree(tiny_model_dir, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert loading.resolve_model_dir("acme/tiny-llama") == snapshot
    with pytest.raises(UserError, match="hf download acme/other"):
        loading.resolve_model_dir("acme/other")


def test_lora_attaches_to_all_linear_layers_but_the_head(tiny_model_dir):
    cfg = ModelConfig(path=str(tiny_model_dir))
    model = loading.load_model(cfg, tiny_model_dir, dtype=torch.float32, device=torch.device("cpu"))
    peft_model = loading.attach_lora(model, LoraConfig(r=4, alpha=8))
    names = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in peft_model.named_parameters() if "lora_A" in n}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    trainable, total = loading.count_params(peft_model)
    assert 0 < trainable < total


@pytest.mark.parametrize(("lora_dtype", "base", "want"), [("float32", torch.bfloat16, torch.float32),
                                                         ("compute", torch.bfloat16, torch.bfloat16),
                                                         ("compute", torch.float16, torch.float32)])
def test_adapter_dtype(tiny_model_dir, lora_dtype, base, want):
    """`lora.dtype: compute` keeps bf16 adapters (and so bf16 AdamW moments) on a bf16 base only."""
    from homelab_ft.plan.inputs import Cluster
    from homelab_ft.plan.planner import default_request
    from homelab_ft.plan.price.params import adapter_bytes
    from homelab_ft.recipe.config import TrainConfig
    from homelab_ft.rung import Rung
    from homelab_ft.train import optim

    cfg = ModelConfig(path=str(tiny_model_dir))
    model = loading.load_model(cfg, tiny_model_dir, dtype=base, device=torch.device("cpu"))
    peft_model = loading.attach_lora(model, LoraConfig(r=4, alpha=8, dtype=lora_dtype), compute_dtype=base)
    assert {p.dtype for p in peft_model.parameters() if p.requires_grad} == {want}
    optimizer = optim.build_optimizer(peft_model, TrainConfig())
    ids = torch.arange(8).reshape(1, 8)
    peft_model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert {s["exp_avg"].dtype for s in optimizer.state.values()} == {want}
    # the planner prices the same bytes per adapter parameter
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[base]
    request = default_request(method="lora", model={"dtype": name}, lora={"dtype": lora_dtype})
    cluster = Cluster(device="cuda", nodes=1, gpus_per_node=1, device_bytes=1, host_ram_bytes=1)
    assert adapter_bytes(Rung("lora", "no_shard", False), request, cluster) == torch.empty((), dtype=want).element_size()


def test_unknown_target_module_is_a_user_error(tiny_model_dir):
    cfg = ModelConfig(path=str(tiny_model_dir))
    model = loading.load_model(cfg, tiny_model_dir, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(UserError, match="lora.target_modules"):
        loading.attach_lora(model, LoraConfig(target_modules=["no_such_proj"]))
