"""How many tokens one chunk of the chunked loss holds: the rule the trainer runs (train/loss.py)
and the planner prices (plan/price/activations.py's logits item, plan/price/network.py's recompute), written
once. Torch-free.

`train.loss_chunk_tokens: auto` (the default) sizes chunks by their logits, not by a token count:
what chunking saves is the [tokens, vocab] logits, so a fixed token count made a small vocabulary
pay for chunks (each checkpointed, its head matmul recomputed in backward) that saved nothing
worth having: 8 chunks of 128 tokens for a 320-entry vocabulary cost 12% of a LoRA step
(bench/lora_step.py: ours/plain 0.88) to keep 0.6 MB of logits out of memory. A number is a fixed
token count as before (tests pin chunk boundaries with it); 0 turns chunking off.
"""

from __future__ import annotations

AUTO = "auto"
LOSS_CHUNK_LOGITS = 128 * 128_256
"""Logits one `auto` chunk holds: 16.4 M entries, 0.23 GB at the 14 B per entry a bf16 chunk peaks
at (activations.logits_bytes). It is what the old default of 128 tokens gave Llama 3's 128,256-entry
vocabulary, the case the chunked loss was built for (7.4 GB of logits at 2 x 2048 tokens
otherwise), so Llama 3 plans and runs keep their 128-token chunks; a 32,000-entry vocabulary takes
513 tokens a chunk, a 320-entry one 51,300 (one chunk for any micro-batch)."""


def chunk_rows(chunk_tokens: int | str, *, vocab_size: int) -> int:
    """Tokens per loss chunk for `train.loss_chunk_tokens`: `auto` as many as keep the chunk's logits
    within LOSS_CHUNK_LOGITS (at least one), a number as given; 0 (the full logits) stays 0."""
    if chunk_tokens == AUTO:
        return max(1, LOSS_CHUNK_LOGITS // max(1, vocab_size))
    return int(chunk_tokens)


def recomputes(chunk_tokens: int | str, *, vocab_size: int, tokens: int) -> bool:
    """Whether the chunked loss over `tokens` trained tokens checkpoints its chunks (the head's matmul
    runs again in backward). A single chunk is not checkpointed: its logits are alive at the start
    of backward either way (recomputed there, or kept from the end of the forward, after which
    nothing else is allocated), so recomputing it would save no memory and cost a head matmul."""
    rows = chunk_rows(chunk_tokens, vocab_size=vocab_size)
    return 0 < rows < tokens
