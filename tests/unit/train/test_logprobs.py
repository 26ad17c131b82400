"""loss.completion_logprobs against log_softmax(model(...).logits) gathered at the completion tokens:
the same values and gradients in fp32 (to 1e-6), on a tiny random Llama loaded through
from_pretrained, with left-padded prompts and completions ending early; and no [B, C, vocab] logits."""

from __future__ import annotations

import pytest
import torch
from tiny import make_llama

from homelab_ft.train import loss

TOL = 1e-6
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs-llama")
    return {tied: make_llama(root / f"tied-{tied}", hidden_size=32, intermediate_size=64, tie_word_embeddings=tied,
                             with_tokenizer=False) for tied in (False, True)}


def _model(path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)


def _batch(vocab: int, seed: int = 0) -> dict:
    """Three rows: prompts of 5, 3 and 7 tokens left-padded to 7, completions of 6, 4 and 1 tokens
    right-padded to 6 (TRL's layout)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, 13), generator=g)
    attention = torch.ones_like(ids)
    attention[0, :2] = attention[1, :4] = 0
    completion = torch.zeros(3, 6, dtype=torch.long)
    completion[0, :] = 1
    completion[1, :4] = 1
    completion[2, :1] = 1
    attention[:, 7:] = completion
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def _reference(model, batch, *, temperature: float = 1.0) -> torch.Tensor:
    """The obvious way: full logits, log_softmax, gather."""
    width = batch["completion_mask"].size(1)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logps = torch.log_softmax(logits[:, -width - 1:-1].float() / temperature, dim=-1)
    picked = logps.gather(-1, batch["input_ids"][:, -width:].unsqueeze(-1)).squeeze(-1)
    return picked * batch["completion_mask"]


def _values_and_grads(model, fn):
    model.zero_grad(set_to_none=True)
    values = fn()
    weights = torch.linspace(-1.0, 2.0, values.numel()).view_as(values)  # every token's gradient differs
    (values * weights).sum().backward()
    return values.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk_tokens", [1, 4, 0, "auto"])
def test_chunked_logprobs_equal_the_full_log_softmax(llama_dirs, tied, chunk_tokens):
    model = _model(llama_dirs[tied])
    batch = _batch(model.config.vocab_size)
    want, want_grads = _values_and_grads(model, lambda: _reference(model, batch))
    got, got_grads = _values_and_grads(
        model, lambda: loss.completion_logprobs(model, batch, device=CPU, chunk_tokens=chunk_tokens))
    assert got.shape == (3, 6) and got.dtype == torch.float32
    assert float((got - want).abs().max()) <= TOL
    assert float(want[batch["completion_mask"] == 1].max()) < 0 and bool((got[batch["completion_mask"] == 0] == 0).all())
    assert got_grads.keys() == want_grads.keys() and want_grads
    for name, ref in want_grads.items():
        scale = max(1.0, float(ref.abs().max()))  # fp32 sums in another order: 1e-6 of the largest entry
        assert float((got_grads[name] - ref).abs().max()) <= TOL * scale, (name, scale)


def test_temperature_divides_the_logits(llama_dirs):
    model = _model(llama_dirs[False])
    batch = _batch(model.config.vocab_size, seed=1)
    with torch.no_grad():
        want = _reference(model, batch, temperature=0.7)
        got = loss.completion_logprobs(model, batch, device=CPU, chunk_tokens=3, temperature=0.7)
        plain = loss.completion_logprobs(model, batch, device=CPU, chunk_tokens=3)
    assert float((got - want).abs().max()) <= TOL
    assert float((got - plain).abs().max()) > 1e-3  # the test can fail: temperature changes them


class _LargestVocabRows(torch.utils._python_dispatch.TorchDispatchMode):
    """Largest row count of any vocab-wide tensor an op produces."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("chunk_tokens", [0, 2])
def test_no_logits_for_the_whole_batch(llama_dirs, chunk_tokens):
    model = _model(llama_dirs[False])
    vocab = model.config.vocab_size
    batch = _batch(vocab)
    with _LargestVocabRows(vocab) as forward:
        values = loss.completion_logprobs(model, batch, device=CPU, chunk_tokens=chunk_tokens)
    with _LargestVocabRows(vocab) as backward:
        values.sum().backward()
    if chunk_tokens == 0:  # the check can fail: the reference path makes [B, S, vocab] logits
        assert forward.rows == batch["input_ids"].numel()
    else:  # the head's weight seen transposed is [hidden, vocab]; a chunk's logits [2, vocab]
        assert max(forward.rows, backward.rows) <= max(chunk_tokens, model.config.hidden_size, 3)
