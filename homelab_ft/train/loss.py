"""The training loss from the final hidden states, in chunks: no full-vocabulary logits.

A causal LM's forward ends with `logits = lm_head(hidden)`: [tokens, vocab] in the activation
dtype, which the loss then upcasts to fp32, and cross-entropy keeps an fp32 log-softmax for
backward while backward allocates an fp32 gradient of the same size. For Llama 3 (128,256 entries)
at 2 x 2048 tokens that is 7.4 GB, more than the 4-bit weights of an 8B model (docs/ladder.md).

Here the head runs on a chunk of tokens at a time (`train.loss_chunk_tokens`; `auto` holds as many
logits as 128 tokens of Llama 3's vocabulary, so a small vocabulary takes one chunk: loss_chunks.py),
and only on the tokens that carry loss (prompt tokens are masked and need no logits at all). Each chunk runs under
`torch.utils.checkpoint` (non-reentrant): its logits are freed as soon as its summed loss exists
and recomputed in backward, one chunk at a time. Peak logits memory is one chunk's, whatever the
micro-batch (128 tokens x 128,256 x 14 B = 0.23 GB instead of 7.4 GB). The price is one more
head matmul per trained token in backward (2 x hidden x vocab FLOPs per token, ~2% of an 8B
step).

The head is called from inside the model's own forward, through a forward pre-hook on the output
embedding module: the hook computes the chunked loss from the hidden states it receives and hands
the head an empty slice, so the model's logits are [batch, 0, vocab]. Going through the top-level
forward keeps every wrapper in charge of what it does there: DDP prepares its gradient reduction;
PEFT applies a LoRA adapter on the head when `lm_head` is targeted; FSDP2's hooks on the head's own
unit (distributed.shard_ends; a tied head sits in the root unit) run before ours, so the head is
gathered when the hook runs and the hidden states it receives carry FSDP2's post-backward hook.
The chunks then call the head's `forward` directly, past its module hooks: through FSDP2's hooks
every chunk, and every chunk recomputed in backward, would register a post-backward of its own,
and the head would be all-gathered and its gradient reduce-scattered once per chunk (measured with
torch 2.13, 2 gloo ranks: 5 chunks, 5 all-gathers and 5 reduce-scatters of the head per
micro-batch). As it is, the head (reshard_after_forward=False) stays gathered from its forward
through the chunks' recompute, and its one post-backward fires when the gradient of the hidden
states is complete, i.e. after the last chunk's backward and before the blocks' backward: one
all-gather and one reduce-scatter per micro-batch, and the head is sharded again while backward
runs through the blocks. The loss is the same summed cross-entropy as `steps.next_token_loss_sum`, so
the normalisation over trained tokens across micro-batches and ranks (steps.loss_scale) is unchanged.

What some architectures do to the logits after the head is applied per chunk too: Gemma 2/3's tanh
soft-capping (`final_logit_softcapping`), Cohere's `logit_scale` and Granite's `logits_scaling`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from homelab_ft.labels import IGNORE_INDEX
from homelab_ft.loss_chunks import chunk_rows
from homelab_ft.train import steps


def batch_loss_sum(model: nn.Module, batch: dict, *, device: torch.device, chunk_tokens: int | str,
                   compiled: bool = False) -> torch.Tensor:
    """Summed next-token cross-entropy (fp32) over the trained tokens of one micro-batch, running
    `model` on it with the head in chunks (`steps.next_token_loss_sum` scores logits already made).
    `chunk_tokens` is train.loss_chunk_tokens (`auto` or a number), which loss_chunks.chunk_rows
    turns into the chunk's size for this vocabulary, as the planner prices it.

    `chunk_tokens=0` runs the model's full logits and one cross-entropy (`steps.next_token_loss_sum`),
    kept as the reference the chunked path is tested against. `compiled` (train.compile) runs each
    chunk's cross-entropy through torch.compile (see `logits_loss_sum`).
    """
    inputs = {k: v.to(device) for k, v in batch.items() if k != "labels"}
    labels = batch["labels"].to(device)
    if chunk_tokens == 0:
        return steps.next_token_loss_sum(model(**inputs, use_cache=False).logits, labels)
    lm = causal_lm(model)
    head = lm.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(lm).__name__} has no output embeddings to compute the loss from")
    transform = LogitTransform.from_config(lm.config)
    rows = chunk_rows(chunk_tokens, vocab_size=lm.config.get_text_config().vocab_size)
    state: dict = {"busy": False}

    def hook(module, args, kwargs):
        if state["busy"]:  # the chunks below call the head themselves
            return None
        hidden = args[0] if args else kwargs["input"]
        state["busy"] = True
        try:
            state["loss"] = chunked_loss_sum(hidden, labels, head=module, chunk_tokens=rows,
                                             transform=transform, compiled=compiled)
        finally:
            state["busy"] = False
        empty = hidden[..., :0, :]
        return ((empty, *args[1:]), kwargs) if args else (args, {**kwargs, "input": empty})

    handle = head.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(**inputs, use_cache=False)
    finally:
        handle.remove()
    if "loss" not in state:
        raise RuntimeError(f"{type(lm).__name__}'s forward never called its output embeddings; "
                           "set train.loss_chunk_tokens=0 for this model")
    return state["loss"]


def chunked_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, *, head: nn.Module, chunk_tokens: int,
                     transform: LogitTransform | None = None, compiled: bool = False) -> torch.Tensor:
    """Summed cross-entropy of `head(hidden)` against `labels` shifted by one, `chunk_tokens` rows
    at a time, over the positions whose next label is trained.

    Targets are the labels shifted left with IGNORE_INDEX appended, so position t of `hidden`
    predicts labels[t + 1] and `hidden` is never sliced into a copy; the trained rows are gathered
    once ([trained, hidden] in the activation dtype, vocab/hidden = 31x smaller than their logits
    for Llama 3 8B). At least one (possibly empty) chunk always runs, so every rank's backward
    reaches the head's parameters (DDP and FSDP expect it).
    """
    transform = transform or LogitTransform()
    loss_fn = _compiled_logits_loss_sum() if compiled else logits_loss_sum
    targets = torch.cat([labels[:, 1:], labels.new_full((labels.size(0), 1), IGNORE_INDEX)], dim=1).reshape(-1)
    keep = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    rows = hidden.reshape(-1, hidden.size(-1)).index_select(0, keep)
    targets = targets.index_select(0, keep)
    # A head with trainable weights (LoRA on lm_head over a frozen trunk) needs the recompute even
    # when the hidden states need no gradient; without it every chunk's logits would wait for backward.
    # A single chunk does not (loss_chunks.recomputes): its logits peak at backward's start either way.
    recompute = (torch.is_grad_enabled() and rows.size(0) > chunk_tokens
                 and (rows.requires_grad or any(p.requires_grad for p in head.parameters())))
    total = None
    for start in range(0, max(rows.size(0), 1), chunk_tokens):
        x, y = rows[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if recompute:
            part = checkpoint(_chunk_loss, x, y, head, transform, loss_fn, use_reentrant=False)
        else:
            part = _chunk_loss(x, y, head, transform, loss_fn)
        total = part if total is None else total + part
    return total


def _chunk_loss(x: torch.Tensor, y: torch.Tensor, head: nn.Module, transform: LogitTransform,
                loss_fn) -> torch.Tensor:
    # `head.forward`, not `head(...)`: the head's module hooks already ran for the model's own call
    # (see the module docstring).
    return loss_fn(head.forward(x), y, transform)


def logits_loss_sum(logits: torch.Tensor, y: torch.Tensor, transform: LogitTransform) -> torch.Tensor:
    """Same operations as the model's forward + steps.next_token_loss_sum: any transform in the
    activation dtype, then cross-entropy on an fp32 copy.

    The head's matmul stays outside: it may be a PEFT LoRA layer or live in FSDP2's root unit, and
    inductor has nothing to fuse in a GEMM. What follows it is elementwise and row reductions,
    which inductor fuses, so the fp32 log-softmax is never stored: bench/compile.py measured the
    peak of a chunk's forward + backward at 8.2 bytes per logit compiled against 12.3 eager (fp32
    on CPU; in bf16 the fp32 copy of the logits should go too: tests/gpu/test_cuda_compile.py).
    """
    return F.cross_entropy(transform(logits).float(), y, reduction="sum")


def _compiled_logits_loss_sum():
    from homelab_ft.model import compiling

    return compiling.compiled(logits_loss_sum)


class LogitTransform:
    """What a model's forward does to the head's output before returning it as logits."""

    def __init__(self, *, softcap: float | None = None, scale: float | None = None, divide: float | None = None):
        self.softcap, self.scale, self.divide = softcap, scale, divide

    @classmethod
    def from_config(cls, config) -> LogitTransform:
        scale = getattr(config, "logit_scale", None)  # Cohere multiplies by it
        return cls(
            softcap=getattr(config, "final_logit_softcapping", None) or None,  # Gemma 2, Gemma 3
            scale=float(scale) if isinstance(scale, (int, float)) else None,
            divide=getattr(config, "logits_scaling", None) or None,  # Granite divides by it
        )

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.scale is not None:
            logits = logits * self.scale
        if self.divide:
            logits = logits / self.divide
        return logits


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers *ForCausalLM under the DDP and PEFT wrappers (FSDP2 wraps in place)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model
