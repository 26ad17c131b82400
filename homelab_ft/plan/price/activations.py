"""What one micro-batch's tensors cost: the activations autograd keeps for backward (with and
without activation checkpointing and offload) and the loss's logits. Pure arithmetic, no torch,
no I/O.

memory.estimate adds these to the model state of a rung; preflight checks the host RAM that
activation offload needs (activation_offload_host_bytes) before a run starts.
"""

from __future__ import annotations

from homelab_ft.plan.inputs import Cluster, PlanRequest
from homelab_ft.plan.price.params import (
    lora_params_per_block,
    qlora_compute_bytes,
    targeted_linears,
    trainable_params,
    weight_bytes,
)
from homelab_ft.plan.shape.shapes import BlockShape, ModelShape
from homelab_ft.rules.loss_chunks import chunk_rows
from homelab_ft.rung import Rung


def activation_bytes(shape: ModelShape, *, rung: Rung, request: PlanRequest, act_bytes: int,
                     offloaded: bool = False) -> int:
    """Tensors autograd keeps for backward on one device, for one micro-batch.

    Per block and token: what one forward of that block kind saved, measured when the shape was
    derived (saved.py: the full fine-tune's saved tensors in this dtype, at this sequence length;
    for a Llama-style block with SDPA that is 8h + 3q + 2kv + 4i elements: each HF RMSNorm keeps an
    fp32 copy of its input, its normalised input and its output; SDPA keeps q, k, v and its output,
    o_proj its input; the MLP its gate, SiLU, up and product). LoRA adds, per targeted linear, its
    dropout's copy of the input plus a 1-byte mask (dropout > 0) and lora_A's r outputs. With
    activation checkpointing only each block's input (h) is kept, plus one block recomputed in full
    during its backward; with activation offload (`offloaded`) those block inputs wait in host RAM
    and only the running block's input is back on the device.
    """
    tokens = request.micro_batch_tokens
    per_block = _block_activation_bytes(shape, rung, request, act_bytes)
    if rung.activation_checkpointing and offloaded:
        per_token = shape.hidden_size * act_bytes + max(per_block)
    elif rung.activation_checkpointing:
        per_token = shape.num_layers * shape.hidden_size * act_bytes + max(per_block)
    else:
        per_token = sum(b.num_blocks * nbytes for b, nbytes in zip(shape.blocks, per_block, strict=True))
    return tokens * per_token


def recomputed_block_bytes(shape: ModelShape, *, rung: Rung, request: PlanRequest, act_bytes: int) -> int:
    """The part of `activation_bytes` that one block recomputed by activation checkpointing holds:
    it exists only once backward has reached the blocks, after the loss has freed its logits."""
    if not rung.activation_checkpointing:
        return 0
    return request.micro_batch_tokens * max(_block_activation_bytes(shape, rung, request, act_bytes))


def _block_activation_bytes(shape: ModelShape, rung: Rung, request: PlanRequest, act_bytes: int) -> list[int]:
    """Bytes per token that autograd keeps for each block kind (see activation_bytes)."""
    per_block = []
    for block in shape.blocks:
        nbytes = block.saved_bytes_per_token(act_bytes, request.sequence_tokens, frozen=rung.adapters_enabled)
        if rung.adapters_enabled:
            nbytes += _adapter_bytes(block, request, act_bytes) + expert_loop_bytes(block, rung, request, act_bytes)
        per_block.append(round(nbytes))
    return per_block


def _adapter_bytes(block: BlockShape, request: PlanRequest, act_bytes: int) -> float:
    """Bytes per token the LoRA adapters of one block keep, on top of its frozen base (measured
    without them, saved.py). Each lora_B keeps lora_A's r outputs. Each lora_A keeps its input: with
    dropout, its own dropped-out copy and the 1-byte mask; without, the layer's input itself, which
    layers fed the same tensor share (q/k/v_proj: one copy) and which costs nothing where the frozen
    block keeps it anyway (o_proj's input is SDPA's saved output). QLoRA's 4-bit base saves no input
    either: bitsandbytes' MatMul4Bit keeps only the packed weight (ctx.tensors = (None, B)), so it
    is priced as a frozen 16-bit linear."""
    targets = targeted_linears(block, request)
    nbytes = len(targets) * request.lora.r * act_bytes
    if request.lora.dropout > 0:
        return nbytes + sum(lin.in_features for lin in targets) * (act_bytes + 1)
    names = {lin.name: lin for lin in targets}
    if not block.saved_frozen:  # a hand-built shape: its full figure already holds every linear's input
        return nbytes
    return nbytes + sum(names[next(n for n in group if n in names)].in_features * act_bytes
                        for group in block.lora_inputs if any(n in names for n in group))


INDEX_BYTES = 8
"""An int64 index element: what both loops keep per routed token to route gradients back."""


def expert_loop_bytes(block: BlockShape, rung: Rung, request: PlanRequest, act_bytes: int) -> float:
    """Bytes per token that model/moe_experts' expert loop keeps beyond the frozen block saved.py
    measured, which runs transformers' own `grouped_mm` experts (what a full fine-tune runs); it
    can be negative (the loop keeps less).

    The loop runs where QLoRA packs the experts in 4 bits, or LoRA's `all-linear` adapts them.
    Measured with saved-tensor hooks on a CPU forward (tests/unit/plan/test_moe_plan.py), per routed
    token (top-k per token) against grouped_mm's, with H the experts' input and output width and I
    the down projection's input (the gate output g):
    - indices: torch.where's two int64 per routed token, and with adapters the one flat index of
      the gate/up adapter's gather, against grouped_mm's three (perm // k, perm, inv_perm);
    - the routing weight's gradient: grouped_mm keeps the H-wide down output; the loop the same,
      or g (I wide) where it scales the down input (moe_experts.scales_down_input: I <= H, or the
      down adapter reads g itself: no dropout, adapters in the activations' dtype); the weighted
      sum (index_put_) keeps nothing more. bnb.matmul_4bit and a frozen matmul keep no input;
    - with adapters on the experts: the gate/up adapter's input once per token, in the adapters'
      dtype (`x.to(a.dtype)`: a 4-byte copy with fp32 adapters on a 16-bit base), with dropout
      its dropped-out copy and the 1-byte mask; per routed token its r gathered lora_A outputs,
      the down adapter's r outputs (twice where the routing weight scales them, with the weight
      cast to the adapters' dtype) and its input g, unless that is g itself, already kept; with
      dropout g's dropped-out copy and mask.
    (bench/memory.py --moe-shape: a 64-expert top-8 qwen3_moe's step was 43% over a plan that
    left the loop out, before the loop kept less.)
    """
    looped = (rung.quantized_enabled and request.quant.bits == 4) or "all-linear" in request.lora.targets
    if not block.expert_stacks or not looped:
        return 0.0
    adapters = "all-linear" in request.lora.targets
    hidden, (inner, out) = block.expert_stacks[0][1], block.expert_stacks[-1][1:]
    lora = _expert_adapter_dtype_bytes(rung, request, act_bytes)
    mask = 1 if request.lora.dropout > 0 else 0
    reads_inner = adapters and not mask and lora == act_bytes
    scale_input = inner <= out or reads_inner
    per_routed = (2 + adapters - 3) * INDEX_BYTES + ((inner - out) * act_bytes if scale_input else 0)
    per_token = 0
    if adapters:
        per_token += hidden * (lora + mask)
        per_routed += request.lora.r * lora * (3 if scale_input else 2) + (lora if scale_input and lora != act_bytes else 0)
        per_routed += 0 if reads_inner else inner * (lora + mask)
    return per_token + block.routed_experts * per_routed


def _expert_adapter_dtype_bytes(rung: Rung, request: PlanRequest, act_bytes: int) -> int:
    """Bytes per element of moe_experts' adapters (params.adapter_bytes): fp32, or with
    lora.dtype=compute bf16 on a bf16 base. `act_bytes` 2 under `auto` means a GPU's bf16."""
    if request.lora.dtype != "compute":
        return 4
    name = request.quant.compute_dtype if rung.quantized_enabled else request.model.dtype
    return 2 if name == "bfloat16" or (name == "auto" and act_bytes == 2) else 4


def offloaded_activation_bytes(shape: ModelShape, request: PlanRequest, act_bytes: int) -> int:
    """Host bytes per rank of activation offload: every block's input, and the final norm's."""
    return request.micro_batch_tokens * (shape.num_layers + 1) * shape.hidden_size * act_bytes


def activation_dtype_bytes(rung: Rung, request: PlanRequest, cluster: Cluster) -> int:
    """Bytes per activation element: the weights' dtype, or for QLoRA the 4-bit base's compute dtype."""
    return qlora_compute_bytes(request, cluster) if rung.quantized_enabled else weight_bytes(request, cluster)


def activation_offload_host_bytes(shape: ModelShape, *, rung: Rung, request: PlanRequest, cluster: Cluster) -> int:
    """Host bytes per rank the rung's activation offload holds (0 when off, or without a GPU to
    offload from); preflight refuses a run whose node has not that much RAM available."""
    if not (rung.activation_offload and rung.activation_checkpointing and cluster.device == "cuda"):
        return 0
    return offloaded_activation_bytes(shape, request, activation_dtype_bytes(rung, request, cluster))


# train.compile (compiling.py) is priced as eager, on purpose. Its fused kernels only free
# intermediates: the compiled cross-entropy stores no fp32 log-softmax (bench/compile.py: a loss
# chunk peaks at 8.2 B per logit instead of 12.3), and AOTAutograd's min-cut partitioner picks
# what a compiled block saves for backward to keep it small, recomputing cheap elementwise results
# instead of storing them; so the eager figures below are an upper bound (tests/gpu/
# test_cuda_compile.py checks a compiled step's peak against eager's). Its speed (1.1-1.2x tokens
# per CPU-second, bench/compile.py) is not credited to step time either, and the first step's
# compiling (seconds to minutes per distinct block graph) is a one-off that step time leaves out.
def logits_bytes(shape: ModelShape, request: PlanRequest, act_bytes: int) -> int:
    """The loss's peak: logits of `rows` tokens x vocab, often the largest single item without
    chunking. Per row and vocab entry: the LM head output (activation dtype); its fp32 copy
    (`logits.float()`, a no-op in fp32); cross-entropy's fp32 log-softmax kept for backward, and
    backward's fp32 gradient of the same size while that is alive. Gemma 2's tanh soft-capping
    keeps one more copy. Rows are the micro-batch's tokens, or with the chunked loss (loss.py) one
    chunk (loss_chunks.chunk_rows: sized by its logits, so a small vocabulary's is the whole micro-batch), plus the trained rows of the hidden states it gathers and their gradient
    (2 x tokens x hidden). DPO's answer log-probabilities (preference.sequence_logps) take the
    full logits of twice the rows (the chunked loss does not serve them yet); the reference's
    no-grad forward runs before the policy's and leaves only one number per row behind."""
    tokens = request.micro_batch_tokens
    per_entry = act_bytes + (4 if act_bytes != 4 else 0) + 4 + 4 + (4 if shape.logit_softcapping else 0)
    if not request.chunked_loss:
        return tokens * shape.vocab_size * per_entry
    rows = min(chunk_rows(request.train.loss_chunk_tokens, vocab_size=shape.vocab_size), tokens)
    return rows * shape.vocab_size * per_entry + 2 * tokens * shape.hidden_size * act_bytes


def gradients_at_recompute(shape: ModelShape, *, rung: Rung, request: PlanRequest, in_backward: bool) -> int:
    """Memory.gradients_at_recompute, in parameters: every block's trainable ones but the first
    block's (a full fine-tune's head is in gradients_in_backward already; adapters sit in the
    blocks, as the trained routers do). None with the gradients offloaded or stepped (and freed) in backward; with gradient
    accumulation they all exist from the start of backward (gradients_in_backward)."""
    if not rung.activation_checkpointing or rung.cpu_offload or in_backward or request.train.grad_accum_steps > 1:
        return 0
    first = next(i for i, b in enumerate(shape.blocks) if b.first_layer == 0)
    if not rung.adapters_enabled:
        return shape.block_params - shape.blocks[first].params
    first_router = shape.blocks[first].router_params if request.lora.train_router else 0
    return trainable_params(shape, request) - lora_params_per_block(shape, request, first) - first_router
