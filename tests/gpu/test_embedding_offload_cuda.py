"""On a CUDA GPU: train.embedding_offload keeps the input embedding table in host RAM, the model
still reports the GPU as its device (generate moves its inputs there), a LoRA step with
activation checkpointing runs and equals the step with the table on the GPU, and the GPU holds
the table's bytes fewer (`make test-gpu`; skipped without CUDA). Written without a GPU at hand."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import build_recipe
import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")]

VOCAB, HIDDEN = 32000, 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("cuda-llama-emb")
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return out


def _step(model_dir: Path, setting):
    from homelab_ft.distributed import comm
    from homelab_ft.plan.planner import named_rung, plan_for_recipe, recipe_shape
    from homelab_ft.recipe.config import recipe_from_dict
    from homelab_ft.train import optim
    from homelab_ft.train.build import build_model
    from homelab_ft.train.trainer import train_step

    recipe = recipe_from_dict(build_recipe.tiny_run(
        model_dir, data={"sources": None, "max_length": 256}, lora={"r": None, "alpha": None},
        train={"max_steps": None, "device": "cuda", "activation_checkpointing": True, "embedding_offload": setting,
               "seed": 0}, output=None))
    env = comm.setup(device_pref="cuda")
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    rung = named_rung(recipe, plan_for_recipe(recipe))  # Rung.embedding_offload decided as `train` decides it
    assert rung.embedding_offload == (setting is not False)
    torch.manual_seed(0)
    model = build_model(recipe, model_dir=model_dir, facts=recipe_shape(recipe)[0].facts, rung=rung, env=env)
    resident = torch.cuda.memory_allocated() - before
    lm = model.get_base_model()
    table = lm.get_input_embeddings().weight
    optimizer = optim.build_optimizer(model, recipe.train)
    s = SimpleNamespace(env=env, model=model, recipe=recipe, rung=rung, optimizer=optimizer,
                        scheduler=optim.build_scheduler(optimizer, recipe.train))
    ids = torch.randint(0, VOCAB, (2, 256), generator=torch.Generator().manual_seed(0))
    result = train_step(s, [{"input_ids": ids, "labels": ids}])
    facts = SimpleNamespace(loss=result.loss, grad_norm=result.grad_norm, resident=resident, table_device=table.device.type,
                            model_device=lm.device.type, table_bytes=table.numel() * table.element_size())
    with torch.no_grad():
        facts.generated = model.generate(input_ids=ids[:1, :8].cuda(), max_new_tokens=4, do_sample=False).cpu()
    del model, optimizer, s
    torch.cuda.empty_cache()
    return facts


def test_table_on_host_and_the_step_runs_on_cuda(model_dir):
    on, off = _step(model_dir, True), _step(model_dir, False)
    assert (on.table_device, on.model_device) == ("cpu", "cuda")
    assert off.table_device == "cuda"
    assert on.loss == off.loss and on.grad_norm == off.grad_norm  # a lookup on the host gives the same rows
    assert torch.equal(on.generated, off.generated)
    # the GPU holds the table's bytes fewer once built (within 1 MiB of allocator rounding)
    assert abs((off.resident - on.resident) - on.table_bytes) < 1 << 20, (off.resident, on.resident, on.table_bytes)
