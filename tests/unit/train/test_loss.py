"""The chunked loss (loss.py) against the full-logits loss of today: same value and gradients in
fp32, with untied and tied heads, LoRA on the head, Gemma 2's soft-capping, and without a
[tokens, vocab] tensor for the whole micro-batch in forward or backward."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from homelab_ft.recipe.config import LoraConfig
from homelab_ft.train import loss, steps
from homelab_ft.train.steps import IGNORE_INDEX

TOL = 1e-5
VOCAB = 256


def _llama(*, tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).float()


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, final_logit_softcapping=2.0,
                          attn_implementation="eager")
    model = Gemma2ForCausalLM(config).float()
    # A random init gives logits far below the cap; scale the head so tanh is really bending them.
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


def _batch(seed: int = 0) -> dict:
    """Two rows of unequal length: padding on the right, a masked prompt, trained answers."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 23), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    labels = ids.clone()
    labels[:, :6] = IGNORE_INDEX
    labels[mask == 0] = IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _loss_and_grads(model, batch, *, chunk_tokens: int):
    model.zero_grad(set_to_none=True)
    summed = loss.batch_loss_sum(model, batch, device=torch.device("cpu"), chunk_tokens=chunk_tokens)
    summed.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(summed), grads


def _assert_parity(model, batch, chunk_tokens: int = 5):
    ref_loss, ref_grads = _loss_and_grads(model, batch, chunk_tokens=0)
    got_loss, got_grads = _loss_and_grads(model, batch, chunk_tokens=chunk_tokens)
    assert ref_loss > 0
    assert abs(got_loss - ref_loss) <= TOL * max(1.0, abs(ref_loss)), (got_loss, ref_loss)
    assert got_grads.keys() == ref_grads.keys() and ref_grads
    for name, ref in ref_grads.items():
        assert float((got_grads[name] - ref).abs().max()) <= TOL, name


def test_reference_is_the_trainer_loss_of_today():
    model, batch = _llama(tied=False), _batch()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    want = steps.next_token_loss_sum(logits, batch["labels"])
    got = loss.batch_loss_sum(model, batch, device=torch.device("cpu"), chunk_tokens=0)
    assert float(got.detach()) == float(want.detach())


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 256])
def test_chunked_matches_full_logits(tied, chunk_tokens):
    model = _llama(tied=tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    _assert_parity(model, _batch(), chunk_tokens)


def test_chunked_matches_with_activation_checkpointing():
    model = _llama(tied=True)
    model.activation_checkpointing_enable({"use_reentrant": False})
    model.train()
    _assert_parity(model, _batch(1))


@pytest.mark.parametrize("targets", [["lm_head"], ["q_proj", "v_proj", "lm_head"], "all-linear"])
def test_chunked_matches_with_lora(targets):
    from homelab_ft.model.loading import attach_lora

    model = attach_lora(_llama(tied=False), LoraConfig(r=4, dropout=0.0, target_modules=targets))
    with torch.no_grad():  # B starts at zero; make the adapters matter for the loss and the grads
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    head_adapted = any("lm_head.lora_A" in n for n, _ in model.named_parameters())
    assert head_adapted == (targets != "all-linear")
    _assert_parity(model, _batch(2))


def test_chunked_matches_with_gemma2_softcapping():
    model = _gemma2()
    _assert_parity(model, _batch(3))


def test_no_trained_token_gives_zero_with_a_graph_to_the_head():
    model = _llama(tied=False)
    batch = _batch()
    batch["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
    summed = loss.batch_loss_sum(model, batch, device=torch.device("cpu"), chunk_tokens=4)
    assert float(summed) == 0.0
    summed.backward()
    assert model.lm_head.weight.grad is not None and float(model.lm_head.weight.grad.abs().max()) == 0.0


def test_eval_without_grad_matches():
    model, batch = _llama(tied=True), _batch(4)
    with torch.no_grad():
        want = loss.batch_loss_sum(model, batch, device=torch.device("cpu"), chunk_tokens=0)
        got = loss.batch_loss_sum(model, batch, device=torch.device("cpu"), chunk_tokens=3)
    assert abs(float(got) - float(want)) <= TOL * float(want)


class _LargestVocabRows(TorchDispatchMode):
    """Largest row count of any tensor with a vocab-sized last dim that an op produces."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == VOCAB:
                self.rows = max(self.rows, t.numel() // VOCAB)
        return out


@pytest.mark.parametrize("chunk_tokens", [0, 4])
def test_no_whole_batch_logits_in_forward_or_backward(chunk_tokens):
    model, batch = _llama(tied=False), _batch()
    with _LargestVocabRows() as forward:
        summed = loss.batch_loss_sum(model, batch, device=torch.device("cpu"), chunk_tokens=chunk_tokens)
    with _LargestVocabRows() as backward:
        summed.backward()
    tokens = batch["input_ids"].numel()
    if chunk_tokens == 0:  # the test can fail: today's path makes [tokens, vocab] logits
        assert forward.rows == tokens
    else:  # the head's weight seen transposed is [hidden, vocab]; logits are [chunk, vocab]
        assert forward.rows <= max(chunk_tokens, model.config.hidden_size)
        assert backward.rows <= max(chunk_tokens, model.config.hidden_size)


def test_logit_transform_reads_the_config():
    from transformers import Gemma2Config, LlamaConfig

    assert loss.LogitTransform.from_config(Gemma2Config(final_logit_softcapping=30.0)).softcap == 30.0
    plain = loss.LogitTransform.from_config(LlamaConfig())
    x = torch.randn(3, 4)
    assert torch.equal(plain(x), x)


def _saved_vocab_tensors(model, batch, *, chunk_tokens: int) -> int:
    """Vocab-wide activations that the forward keeps for backward (outside the recomputed chunks;
    weights, such as lora_B seen transposed, are not counted)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(t):
        if t.dim() >= 1 and t.shape[-1] == VOCAB and t.untyped_storage().data_ptr() not in weights:
            saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        summed = loss.batch_loss_sum(model, batch, device=torch.device("cpu"), chunk_tokens=chunk_tokens)
    summed.backward()
    return len(saved)


def test_lora_on_the_head_alone_recomputes_its_chunks():
    """LoRA on lm_head over a frozen trunk: the hidden states need no gradient but the head does;
    each chunk's logits must still be recomputed in backward, not kept (checked through what the
    forward saves for backward: nothing vocab-wide, against the full-logits path that keeps it)."""
    from homelab_ft.model.loading import attach_lora

    model = attach_lora(_llama(tied=False), LoraConfig(r=4, dropout=0.0, target_modules=["lm_head"]))
    batch = _batch(5)
    assert _saved_vocab_tensors(model, batch, chunk_tokens=0) > 0  # the check can fail
    assert _saved_vocab_tensors(model, batch, chunk_tokens=4) == 0
    _assert_parity(model, batch, 4)


def test_auto_chunks_by_logits_so_a_small_vocabulary_takes_one_unrecomputed_chunk(monkeypatch):
    """Issue 24 item 11: `auto` (the default) sized in tokens gave this 256-entry vocabulary a
    128-token chunk; sized by logits it is one chunk, whose head is neither run again in backward
    nor split, and whose loss and gradients are the full-logits path's."""
    from homelab_ft.recipe.config import recipe_from_dict
    from homelab_ft.rules import loss_chunks

    assert recipe_from_dict({}).train.loss_chunk_tokens == "auto"
    assert loss_chunks.chunk_rows("auto", vocab_size=128_256) == 128  # Llama 3 keeps its chunks
    assert loss_chunks.chunk_rows("auto", vocab_size=VOCAB) == 128 * 128_256 // VOCAB
    assert loss_chunks.chunk_rows(5, vocab_size=VOCAB) == 5 and loss_chunks.chunk_rows(0, vocab_size=VOCAB) == 0
    model, batch = _llama(tied=False), _batch(3)
    _assert_parity(model, batch, "auto")
    calls = []
    head_forward = model.lm_head.forward
    # the chunks call the head on [rows, hidden]; the model's own call gets an empty [batch, 0, hidden]
    monkeypatch.setattr(model.lm_head, "forward", lambda x: (x.dim() == 2 and calls.append(x.shape[0])) or head_forward(x))
    loss.batch_loss_sum(model, batch, device=torch.device("cpu"), chunk_tokens="auto").backward()
    assert calls == [int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())]  # one chunk, run once
    calls.clear()
    loss.batch_loss_sum(model, batch, device=torch.device("cpu"), chunk_tokens=5).backward()
    assert len(calls) > 2 * 5  # a number is still a token count: chunks of 5, each recomputed
