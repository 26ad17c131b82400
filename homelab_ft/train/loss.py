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
the head one position per row, so the model's logits are [batch, 1, vocab] (`check_transform`). Going through the top-level
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

What some architectures do to the logits after the head is applied per chunk too (`LogitTransform`,
read from the config of the decoder the model runs, `text_config` included), and checked once per
model against what its own forward returns for the head's output on one position per row
(`check_transform`), so a transform the config keys do not describe refuses the run instead of
training another loss.

GRPO needs no summed loss but each completion token's log-probability (`completion_logprobs`): the
same hook, the same chunks and the same recompute, each chunk's logits reduced to one number per
token (the picked logit minus the log-sum-exp) before the next chunk's exist.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from homelab_ft.errors import UserError
from homelab_ft.labels import IGNORE_INDEX
from homelab_ft.rules.loss_chunks import chunk_rows
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

    def compute(hidden, head, transform, rows):
        return chunked_loss_sum(hidden, labels, head=head, chunk_tokens=rows, transform=transform, compiled=compiled)

    return from_final_hidden(model, inputs, chunk_tokens=chunk_tokens, compute=compute)


def from_final_hidden(model: nn.Module, inputs: dict, *, chunk_tokens: int | str, compute):
    """Run `model` on `inputs` and return `compute(hidden, head, transform, rows)`, called on the final
    hidden states from inside the model's forward in place of the head's whole output (the module
    docstring says why from inside): `head` is the output embedding module, `transform` what the
    model does to the head's output, `rows` the chunk size loss_chunks.chunk_rows makes of `chunk_tokens`.
    The head itself runs on one position per row, and what the model returns for it checks the transform."""
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
            state["value"] = compute(hidden, module, transform, rows)
        finally:
            state["busy"] = False
        probe = hidden[..., :1, :]  # the model's own head and transform run on one position per row
        return ((probe, *args[1:]), kwargs) if args else (args, {**kwargs, "input": probe})

    def seen(module, args, output):
        if not state["busy"]:
            state["head_output"] = output.detach()

    handles = [head.register_forward_pre_hook(hook, with_kwargs=True), head.register_forward_hook(seen)]
    try:
        logits = model(**inputs, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    if "value" not in state:
        raise RuntimeError(f"{type(lm).__name__}'s forward never called its output embeddings; "
                           "set train.loss_chunk_tokens=0 for this model")
    if lm not in _CHECKED:
        check_transform(transform, head_output=state["head_output"], logits=logits.detach(), model_name=type(lm).__name__)
        _CHECKED.add(lm)
    return state["value"]


_CHECKED: weakref.WeakSet = weakref.WeakSet()
"""Models whose logit transform was checked against their own forward (once: it costs a sync)."""


def check_transform(transform: LogitTransform, *, head_output: torch.Tensor, logits: torch.Tensor,
                    model_name: str) -> None:
    """Refuse a model whose forward does to the head's output something `transform` does not.

    The model's own forward ran its head on one position per row (`batch_loss_sum`'s hook) and
    returned what it made of it: the chunked loss applies `transform` to the same head output, so
    the two must agree to the rounding of the activation dtype (the operations are the same, in the
    same order). A transform read from a config key another family spells differently, a vocabulary
    sliced after the head, a multiplier kept on a submodule: each shows here, on the first
    micro-batch, instead of a run that optimises another loss without a word.
    """
    ours = transform(head_output)
    eps = torch.finfo(logits.dtype).eps if logits.dtype.is_floating_point else 0.0
    scale = float(logits.abs().max()) if logits.numel() else 0.0
    if not math.isfinite(scale):  # diverged weights: nothing to compare; the step's guard stops the run (divergence.py)
        return
    if ours.shape != logits.shape or not torch.allclose(ours.float(), logits.float(), rtol=16 * eps,
                                                        atol=16 * eps * max(scale, 1.0)):
        raise UserError(
            f"{model_name}'s forward transforms its head's output in a way the chunked loss does not know "
            f"({transform}); set train.loss_chunk_tokens=0, which trains on the model's own logits"
        )


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
    recompute = _recomputes(rows, head=head, chunk_tokens=chunk_tokens)
    total = None
    for start in range(0, max(rows.size(0), 1), chunk_tokens):
        x, y = rows[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if recompute:
            part = checkpoint(_chunk_loss, x, y, head, transform, loss_fn, use_reentrant=False)
        else:
            part = _chunk_loss(x, y, head, transform, loss_fn)
        total = part if total is None else total + part
    return total


def completion_logprobs(model: nn.Module, batch: dict, *, device: torch.device, chunk_tokens: int | str,
                        temperature: float = 1.0) -> torch.Tensor:
    """The log-probability of each completion token under `model` ([B, C], fp32; 0 where
    `completion_mask` is 0), for GRPO's ratios and KL (grpo_loss.policy_loss), with the head in
    chunks as the loss runs it: no [B, C, vocab] logits.

    `batch` holds `input_ids` and `attention_mask` [B, S] with the completions in the last C
    positions (prompts left-padded, TRL's layout), and `completion_mask` [B, C]. The logits are
    divided by `temperature` before the softmax, as TRL does, so the log-probs are those of the
    distribution the completions were sampled from. `chunk_tokens=0` runs the model's full logits
    and a log-softmax, the reference the chunked path is tested against.
    """
    inputs = {k: v.to(device) for k, v in batch.items() if k != "completion_mask"}
    mask = batch["completion_mask"].to(device)
    width = mask.size(1)
    targets = inputs["input_ids"][:, -width:]
    if chunk_tokens == 0:
        logits = model(**inputs, use_cache=False).logits[:, -width - 1:-1].float() / temperature
        picked = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return torch.where(mask.bool(), picked, torch.zeros_like(picked))

    def compute(hidden, head, transform, rows):
        return chunked_logprobs(hidden, targets, mask, head=head, chunk_tokens=rows, transform=transform,
                                temperature=temperature)

    return from_final_hidden(model, inputs, chunk_tokens=chunk_tokens, compute=compute)


def chunked_logprobs(hidden: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, *, head: nn.Module,
                     chunk_tokens: int, transform: LogitTransform | None = None,
                     temperature: float = 1.0) -> torch.Tensor:
    """log softmax(head(hidden) / temperature) at `targets` ([B, C], the last C tokens of each row),
    `chunk_tokens` rows at a time, for the positions where `mask` is 1; 0 elsewhere.

    Position t of `hidden` [B, S, H] predicts token t + 1, so target c is read from position
    S - C - 1 + c; only the masked-in rows are gathered (padding after an early end of sequence
    needs no logits). Each chunk is recomputed in backward under the same rule as `chunked_loss_sum`.
    """
    transform = transform or LogitTransform()
    batch, seq, width = hidden.size(0), hidden.size(1), targets.size(1)
    keep = mask.reshape(-1).nonzero().squeeze(1)
    position = (keep // width) * seq + (seq - width - 1) + keep % width
    rows = hidden.reshape(-1, hidden.size(-1)).index_select(0, position)
    picked = targets.reshape(-1).index_select(0, keep)
    recompute = _recomputes(rows, head=head, chunk_tokens=chunk_tokens)
    parts = []
    for start in range(0, max(rows.size(0), 1), chunk_tokens):
        x, y = rows[start:start + chunk_tokens], picked[start:start + chunk_tokens]
        if recompute:
            parts.append(checkpoint(_chunk_logprobs, x, y, head, transform, temperature, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(x, y, head, transform, temperature))
    values = torch.cat(parts)
    return values.new_zeros(batch * width).index_copy(0, keep, values).view(batch, width)


def _chunk_logprobs(x: torch.Tensor, y: torch.Tensor, head: nn.Module, transform: LogitTransform,
                    temperature: float) -> torch.Tensor:
    logits = transform(head.forward(x)).float() / temperature  # `head.forward`: see _chunk_loss
    return logits.gather(-1, y.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _recomputes(rows: torch.Tensor, *, head: nn.Module, chunk_tokens: int) -> bool:
    """Whether each chunk runs under checkpoint. A head with trainable weights (LoRA on lm_head over a
    frozen trunk) needs the recompute even when the hidden states need no gradient; without it every
    chunk's logits would wait for backward. A single chunk does not (loss_chunks.recomputes): its
    logits peak at backward's start either way."""
    return (torch.is_grad_enabled() and rows.size(0) > chunk_tokens
            and (rows.requires_grad or any(p.requires_grad for p in head.parameters())))


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
    """What a model's forward does to the head's output before returning it as logits: Gemma 2/3/4's
    tanh soft-capping, then a multiplier (Cohere's `logit_scale`, Falcon-H1's `lm_head_multiplier`)
    or a divisor (Granite's `logits_scaling`), read from the config of the decoder the model runs."""

    def __init__(self, *, softcap: float | None = None, scale: float | None = None, divide: float | None = None):
        self.softcap, self.scale, self.divide = softcap, scale, divide

    @classmethod
    def from_config(cls, config) -> LogitTransform:
        """The transform of `config`'s text decoder: a multimodal checkpoint (Gemma 4, Qwen 3.5) keeps
        these keys in its `text_config`, where the top-level config has none or only defaults."""
        text = config.get_text_config(decoder=True)

        def number(key: str) -> float | None:
            value = getattr(text, key, None)
            if value is None:
                value = getattr(config, key, None)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

        multipliers = [v for v in (number("logit_scale"), number("lm_head_multiplier")) if v is not None and v != 1.0]
        divide = number("logits_scaling")
        return cls(
            softcap=number("final_logit_softcapping") or None,
            scale=multipliers[0] if multipliers else None,
            divide=divide if divide not in (None, 0.0, 1.0) else None,
        )

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.softcap:
            logits = logits / self.softcap
            logits = torch.tanh(logits)
            logits = logits * self.softcap
        if self.scale is not None:
            logits = logits * self.scale
        if self.divide:
            logits = logits / self.divide
        return logits

    def __repr__(self) -> str:
        parts = [f"{k}={v}" for k, v in (("softcap", self.softcap), ("scale", self.scale), ("divide", self.divide)) if v]
        return f"logit transform: {', '.join(parts) or 'none'}"


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers *ForCausalLM under the DDP and PEFT wrappers (FSDP2 wraps in place)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model
