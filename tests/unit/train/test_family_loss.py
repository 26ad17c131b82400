"""The chunked loss equals each family's own loss (`model(input_ids, labels=...)`), fp32, 1e-5.

Every family of tests/families.py, with every logit transform its decoder config declares set to a
value that changes the loss (soft-capping that really bends the logits, a multiplier, a divisor),
plus Gemma 4's multimodal checkpoint, whose soft-capping lives in `text_config` (issue 20: read
from the top-level config only, it was skipped and the run optimised another loss without a word).
"""

from __future__ import annotations

import pytest
import torch
from families import FAMILIES, tiny_config

from homelab_ft.errors import UserError
from homelab_ft.labels import IGNORE_INDEX
from homelab_ft.train import loss

TOL = 1e-5
TRANSFORMS = {"final_logit_softcapping": 2.0, "lm_head_multiplier": 0.5, "logits_scaling": 4.0, "logit_scale": 0.25}
"""Values that change the loss visibly; each is set where the family's decoder config declares the key."""


def _model(model_type: str, **overrides):
    from transformers import AutoModelForCausalLM

    default = tiny_config(model_type).get_text_config(decoder=True)
    keys = {k: v for k, v in TRANSFORMS.items() if hasattr(default, k)}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **keys, **overrides), dtype=torch.float32)
    with torch.no_grad():  # random init gives logits far below a cap of 2: make tanh bend them
        model.get_output_embeddings().weight.mul_(20)
    return model.train(), keys


def _batch(vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2, 12), generator=g)
    labels = ids.clone()
    labels[:, :4] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("model_type", [*FAMILIES, "gemma4"])
def test_chunked_loss_equals_the_model_own_loss(model_type):
    model, keys = _model(model_type)
    batch = _batch(model.config.get_text_config().vocab_size)
    trained = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    with torch.no_grad():
        torch.manual_seed(1)  # the same draws for both: Phi-MoE's router samples in training mode
        want = float(model(**batch, use_cache=False).loss)
        torch.manual_seed(1)
        got = float(loss.batch_loss_sum(model, batch, device=torch.device("cpu"), chunk_tokens=5)) / trained
    assert got == pytest.approx(want, rel=TOL, abs=TOL), keys
    if model_type in ("gemma4", "falcon_h1"):  # the two issue 20 names: the transform is really there
        assert keys and loss.LogitTransform.from_config(model.config).__repr__() != "logit transform: none"


def test_a_transform_the_config_does_not_describe_is_refused():
    """A forward that scales its logits by a key loss.py does not read (hyperclovax multiplies by
    `logits_scaling`, which Granite divides by) refuses the run on the first micro-batch."""
    model, _ = _model("llama")
    forward = model.lm_head.forward
    model.lm_head.forward = lambda x: forward(x) * 3.0  # the chunks see it too: the model's own head
    original = type(model).forward

    def scaled(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    type(model).forward, restore = scaled, original
    try:
        with pytest.raises(UserError, match="loss_chunk_tokens=0"):
            loss.batch_loss_sum(model, _batch(320), device=torch.device("cpu"), chunk_tokens=5)
    finally:
        type(model).forward = restore


@pytest.mark.parametrize("model_type", ["gemma2", "granitemoehybrid", "falcon_h1", "gemma4"])
def test_the_check_passes_in_bf16(model_type):
    """GPU runs train in bf16: the model's transform and ours are the same operations on the same
    head output, so the first micro-batch's check must not refuse them at bf16 rounding."""
    model, keys = _model(model_type)
    model = model.to(torch.bfloat16)
    assert keys
    with torch.no_grad():
        loss.batch_loss_sum(model, _batch(model.config.get_text_config().vocab_size), device=torch.device("cpu"),
                            chunk_tokens=5)
