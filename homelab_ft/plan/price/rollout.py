"""What a GRPO step adds to SFT's (issue 33): the rollout. Pure arithmetic, no torch, no I/O.

The trainer's step, per optimizer step and for each of `train.grad_accum_steps` micro-batches of
`train.micro_batch_size` prompts (each at most `data.max_length` tokens, left-padded; seconds are
priced at their measured expected width when the CLI has the lengths, PlanRequest.timed_prompt_tokens,
bytes at `data.max_length`):
1. `generate` samples `grpo.num_generations` completions of each prompt (up to
   `grpo.max_completion_length` new tokens, KV cache, no grad): one prefill of the prompts, then one
   decode step per new token over micro_batch_size x num_generations rows;
2. with `grpo.num_iterations` > 1, a no-grad forward for the sampling policy's log-probs;
3. with `grpo.beta` > 0, a no-grad forward of the reference (the adapters disabled: LoRA and QLoRA
   only, rules/refusals.grpo_reference);
4. the training forward and backward over those rows at prompt + completion tokens, which memory.py
   and network.py price as SFT's (PlanRequest.rows_per_micro_batch, .sequence_tokens), its
   per-token log-probs from the chunked head as the chunked SFT loss (activations.logits_bytes).
A batch is sampled once and trained on for `num_iterations` optimizer steps, so 1 and 2 cost
1/num_iterations of their time per step (2 runs on the first of them only); 3 runs on every step.

Memory: generation's peak (`generation_bytes`) is what stays resident between the phases (weights,
optimizer state, accumulated gradients, FSDP's gathered units) plus the KV cache of the rows at
full length and the larger of the prefill's block intermediates and a decode step's logits;
memory.Memory.total is the larger of it and training's peak, and the plan shows both.

With `grpo.rollout: node` (train/rollout_node.py) the generation runs on the
rollout node's GPU, which holds the base and the adapters only (no optimizer state, no gradients):
its peak is that plus the KV cache and transients, and the trainer's is training's alone; both are
checked against the smaller GPU (Cluster.device_bytes). The step adds the adapters' sync over the
link between the nodes, once per sampled batch, and the trainer runs no gradient all-reduce (it is
one process). With `grpo.max_staleness: 1` the node generates the next step's batch (and scores it
once for truncated importance sampling) while this step trains: the step is the sync plus the
longer of the two (`Rollout.step_s`).
"""

from __future__ import annotations

from dataclasses import dataclass

from homelab_ft.plan.inputs import Cluster, PlanRequest
from homelab_ft.plan.price.network import OFFLOAD_BYTES_PER_S, QLORA_SLOWDOWN, collective_s, matmul_params
from homelab_ft.plan.shape.shapes import ModelShape
from homelab_ft.rung import Rung

DEQUANT_BYTES_PER_PARAM = 4
"""Bytes a 4- or 8-bit weight costs a decode step beyond its packed bytes: bitsandbytes' matmul_4bit
takes its one-row gemv kernel only for a single token (A.numel() == A.shape[-1]); a batch of rows
dequantizes the whole weight to the compute dtype first (dequantize_4bit) and runs a 16-bit matmul,
writing and reading back 2 bytes per parameter."""

# Eager `generate` launches every op of every block from Python, one decode step after another: the
# host's time per block is a floor under a decode step however fast the device. GPU: gpt-fast's
# eager baseline ("Accelerating Generative AI with PyTorch II: GPT, Fast", PyTorch blog 2023) decodes
# Llama-7B at 25.5 tokens/s on an A100, 39 ms for 32 blocks, bound by that overhead (its kernels
# need ~7 ms). CPU: bench/decode_overhead.py, 0.37-0.40 ms per block (a Qwen3 shrunk to hidden 64,
# 8 rows, one thread, two runs on this project's 2-core machine), PEFT's LoRA on every linear
# 0.71-0.79 ms: x 1.8-2.2, taken as 2 for adapters on either device (QLoRA's dequantizing adds
# launches not measured).
DECODE_HOST_S_PER_BLOCK = {"cuda": 39e-3 / 32, "cpu": 0.4e-3}
ADAPTER_HOST_FACTOR = 2.0


@dataclass(frozen=True)
class Rollout:
    """What a GRPO step's rollout costs on one device (module docstring)."""

    kv_cache_bytes: int
    """The KV cache of one micro-batch's rows at prompt + completion tokens."""
    generation_s: float
    """`generate` per optimizer step: grad_accum_steps micro-batches, / num_iterations."""
    old_logprob_s: float
    """The sampling policy's no-grad forward per optimizer step (num_iterations > 1), / num_iterations."""
    reference_s: float
    """The reference's no-grad forward per optimizer step (beta > 0)."""
    decode_step_s: float
    """One decode step over the micro-batch's rows."""
    decode_bound: str
    """What sets `decode_step_s`: `memory` (the bytes read), `compute` (the FLOPs) or `host` (launching the ops)."""
    node: bool = False
    """Generated on the rollout node (grpo.rollout: node), not on the training GPU."""
    adapter_bytes: int = 0
    """The adapters sent to the rollout node per sync (node only)."""
    sync_s: float = 0.0
    """Their trip over the link between the nodes, per optimizer step (node only)."""
    overlapped: bool = False
    """The node generates the next step's batch while this step trains (grpo.max_staleness: 1)."""
    node_logprob_s: float = 0.0
    """The node's no-grad forward for the sampling policy's log-probs (overlapped only: the weights
    for truncated importance sampling), per optimizer step."""

    @property
    def seconds(self) -> float:
        """Every second the rollout adds, on whichever device it runs (Memory.step_s overlaps them)."""
        return self.generation_s + self.old_logprob_s + self.reference_s + self.sync_s + self.node_logprob_s

    def step_s(self, training_s: float) -> float:
        """One optimizer step with `training_s` of training: the phases one after the other, or with
        the node overlapped the longer of the trainer's part and the node's, after the sync."""
        if not self.overlapped:
            return training_s + self.seconds
        return self.sync_s + max(training_s + self.reference_s + self.old_logprob_s,
                                 self.generation_s + self.node_logprob_s)


def kv_cache_bytes(shape: ModelShape, request: PlanRequest, act_bytes: int) -> int:
    """Rows x (prompt + completion) tokens x the KV width: a key and a value per cached layer
    (ModelShape.kv_elements_per_token) in the compute dtype."""
    return request.micro_batch_tokens * shape.kv_elements_per_token * act_bytes


def decode_logits_bytes(shape: ModelShape, request: PlanRequest, act_bytes: int) -> int:
    """One decode step's logits, [rows, vocab]: the head's output (compute dtype; generate asks for the
    last position only), generate's fp32 copy and the sampler's fp32 probabilities; top_p < 1 sorts
    them too (fp32 values and int64 indices)."""
    per_entry = act_bytes + 4 + 4 + (12 if request.grpo.top_p < 1 else 0)
    return request.rows_per_micro_batch * shape.vocab_size * per_entry


def prefill_bytes(shape: ModelShape, *, rung: Rung, request: PlanRequest, act_bytes: int) -> int:
    """The prefill's transient: one block's intermediates over the rows' prompts, priced as what that
    block would save for backward at that length (saved.py's measurement; a no-grad forward frees
    them block by block, so one block's at a time)."""
    prompt = request.data.max_length
    per_token = max(b.saved_bytes_per_token(act_bytes, prompt, frozen=rung.adapters_enabled) for b in shape.blocks)
    return round(request.rows_per_micro_batch * prompt * per_token)


def generation_bytes(shape: ModelShape, *, rung: Rung, request: PlanRequest, act_bytes: int, resident: int) -> int:
    """Bytes on one device at generation's peak (overhead aside): `resident` (what the step keeps
    between its phases) + the KV cache + the larger of the prefill's and a decode step's transients;
    0 for an objective that does not generate."""
    if request.objective != "grpo":
        return 0
    transient = max(prefill_bytes(shape, rung=rung, request=request, act_bytes=act_bytes),
                    decode_logits_bytes(shape, request, act_bytes))
    return resident + kv_cache_bytes(shape, request, act_bytes) + transient


def rollout(shape: ModelShape, *, rung: Rung, request: PlanRequest, cluster: Cluster, act_bytes: int,
            base_bytes: int, adapter_bytes: int = 0) -> Rollout | None:
    """The rollout's bytes and seconds per optimizer step (module docstring); None without GRPO.
    `base_bytes`: the whole model's weights, adapters included (memory._Sizes.base_bytes);
    `adapter_bytes`: the trainable adapters' bytes, what a rollout node receives per sync.

    Prefill and the no-grad forwards are compute-bound: 2 FLOPs per matmul parameter and token
    (network.compute_s's forward), QLoRA's dequantizing at QLORA_SLOWDOWN. A decode step over the
    rows is bound by the larger of its FLOPs and the bytes it reads at the memory's bandwidth
    (Cluster.memory_bandwidth): every weight but the embedding lookup (a quantized base's packed
    bytes plus DEQUANT_BYTES_PER_PARAM), and the KV cache at its mean length over the decode; and
    never faster than the host launches its ops (DECODE_HOST_S_PER_BLOCK)."""
    if request.objective != "grpo":
        return None
    grpo, rows, prompt = request.grpo, request.rows_per_micro_batch, request.timed_prompt_tokens
    new, accum = grpo.max_completion_length, request.train.grad_accum_steps
    flops_per_s = cluster.tflops * 1e12
    slowdown = QLORA_SLOWDOWN if rung.quantized_enabled else 1.0
    params = matmul_params(shape)
    looked_up = (shape.embedding_params - shape.vocab_size * shape.hidden_size * shape.tie_word_embeddings) * act_bytes
    weights_read = base_bytes - looked_up
    if rung.quantized_enabled:
        weights_read += (shape.linear_weight_params + shape.expert_weight_params * (request.quant.bits == 4)) \
            * DEQUANT_BYTES_PER_PARAM
    kv_read = rows * (prompt + new / 2) * shape.kv_elements_per_token * act_bytes
    host_s = shape.num_layers * DECODE_HOST_S_PER_BLOCK[cluster.device] * (ADAPTER_HOST_FACTOR if rung.adapters_enabled else 1)
    bounds = {"memory": (weights_read + kv_read) / cluster.memory_bandwidth, "compute": 2 * params * rows / flops_per_s,
              "host": host_s}
    bound = max(bounds, key=bounds.get)
    decode_s = bounds[bound]
    fetch_s = weight_fetch_s(rung=rung, cluster=cluster, base_bytes=base_bytes)
    # with reshard_after_forward every forward gathers the blocks again; SHARD_GRAD_OP keeps them
    # gathered from the first no-grad forward on (nothing runs backward to reshard them)
    fetches = 1 + new if rung.reshard_after_forward or rung.cpu_offload else 1
    prefill_s = 2 * params * rows * prompt / flops_per_s * slowdown
    per_micro_batch = prefill_s + new * decode_s + fetches * fetch_s
    scoring_s = 2 * params * request.timed_micro_batch_tokens / flops_per_s * slowdown + fetch_s
    node = rung.rollout_node_enabled
    overlapped = node and rung.rollout_staleness > 0
    return Rollout(
        kv_cache_bytes=kv_cache_bytes(shape, request, act_bytes),
        generation_s=accum * per_micro_batch / grpo.num_iterations,
        old_logprob_s=accum * scoring_s / grpo.num_iterations if grpo.num_iterations > 1 else 0.0,
        reference_s=accum * scoring_s if grpo.beta > 0 else 0.0,
        decode_step_s=decode_s, decode_bound=bound, node=node, adapter_bytes=adapter_bytes if node else 0,
        sync_s=adapter_sync_s(adapter_bytes, cluster) / grpo.num_iterations if node else 0.0,
        overlapped=overlapped, node_logprob_s=accum * scoring_s / grpo.num_iterations if overlapped else 0.0,
    )


def adapter_sync_s(adapter_bytes: int, cluster: Cluster) -> float:
    """One broadcast of the adapters to the rollout node: their bytes over the link between the
    nodes (its collective bandwidth), plus a round trip's latency for the request that carries them."""
    return adapter_bytes / cluster.inter_bytes_per_s + 4 * cluster.inter_hop_s


def weight_fetch_s(*, rung: Rung, cluster: Cluster, base_bytes: int) -> float:
    """Seconds one no-grad forward spends bringing the weights it does not hold: FSDP2's all-gather
    of every unit over the shard group (no overlap with the small decode steps credited), and with
    CPU offload the shard's copy to the device first; 0 for a device that holds them."""
    if rung.shard_size == 1 and not rung.cpu_offload:
        return 0.0
    spans_nodes = cluster.nodes > 1 and not rung.hybrid_enabled
    link = dict(bytes_per_s=cluster.inter_bytes_per_s if spans_nodes else cluster.intra_bytes_per_s,
                hop_s=cluster.inter_hop_s if spans_nodes else cluster.intra_hop_s)
    copy_s = base_bytes / rung.shard_size / OFFLOAD_BYTES_PER_S if rung.cpu_offload else 0.0
    return copy_s + collective_s(base_bytes, ranks=rung.shard_size, **link)
