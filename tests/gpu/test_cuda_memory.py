"""On a CUDA GPU: a few training steps of every rung and memory switch on a small Llama with a
128k vocabulary, with `torch.cuda.max_memory_allocated` against the planner's device total
(minus its fixed CUDA context + fragmentation item, which the allocator does not see).

`make test-gpu` runs these; without CUDA they are skipped. Written without a GPU at hand: the
tolerance is the issue's goal (10%) and a failure prints both numbers and the plan's items.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import build_recipe
import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")]

TOLERANCE = 0.10
VOCAB = 128256
CASES = {
    "qlora": ("qlora", {}),
    "lora": ("lora", {}),
    "lora full logits": ("lora", {"loss_chunk_tokens": 0}),
    "lora offload": ("lora", {"activation_checkpointing": True, "activation_offload": True}),
    "lora bf16 adapters": ("lora", {}, {"dtype": "compute"}),
    "full": ("full", {}),
    "full optim_in_bwd": ("full", {"optimizer_in_backward": True, "max_grad_norm": 0.0}),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("cuda-llama")
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_peak_matches_the_plan(model_dir, name):
    from homelab_ft.distributed import comm
    from homelab_ft.locate import read_model_config
    from homelab_ft.plan.hardware import detect, resolve_cluster
    from homelab_ft.plan.ladder import option_rung
    from homelab_ft.plan.planner import recipe_shape, request_from_recipe
    from homelab_ft.plan.price.memory import estimate
    from homelab_ft.plan.shape.shapes import model_shape
    from homelab_ft.recipe.config import ClusterConfig, recipe_from_dict
    from homelab_ft.rung import rung_for
    from homelab_ft.train import optim
    from homelab_ft.train.build import build_model
    from homelab_ft.train.trainer import train_step

    method, train, *lora = CASES[name]
    recipe = recipe_from_dict(build_recipe.tiny_run(
        model_dir, method=method, data={"sources": None, "max_length": 2048},
        lora={"r": None, "alpha": None, **(lora[0] if lora else {})},
        train={"max_steps": None, "device": "cuda", "micro_batch_size": 1, "lr": 1e-4, **train}, output=None))
    env = comm.setup(device_pref="cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build_model(recipe, model_dir=model_dir, facts=recipe_shape(recipe)[0].facts, rung=rung_for(recipe),
                        env=env)
    optimizer = optim.build_optimizer(model, recipe.train)
    s = SimpleNamespace(env=env, model=model, recipe=recipe, rung=rung_for(recipe), optimizer=optimizer,
                        scheduler=optim.build_scheduler(optimizer, recipe.train))
    ids = torch.randint(0, VOCAB, (1, 2048), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        loss = train_step(s, [{"input_ids": ids, "labels": ids}]).loss
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()

    shape = model_shape(read_model_config(str(model_dir)))
    cluster = resolve_cluster(ClusterConfig(device="cuda"), detected=detect())
    memory = estimate(shape, rung=option_rung(method, "no_shard", False, request=request_from_recipe(recipe), cluster=cluster), request=request_from_recipe(recipe), cluster=cluster).memory
    planned = memory.total - memory.overhead
    del model, optimizer, s
    torch.cuda.empty_cache()
    assert loss == loss  # finite
    assert abs(measured / planned - 1) <= TOLERANCE, (name, measured, planned, memory)
