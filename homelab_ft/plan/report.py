"""The plan as text: the table `homelab-ft plan` prints, one row per option with the chosen one
marked, the links it assumed, and the verdict, advice and warnings the plan carries. Pure: it
formats what planner.plan decided and decides nothing.
"""

from __future__ import annotations

import math

from homelab_ft.plan.inputs import Cluster, PlanRequest
from homelab_ft.plan.ladder import Option
from homelab_ft.plan.planner import Plan
from homelab_ft.plan.price.activations import activation_dtype_bytes
from homelab_ft.plan.price.images import images_per_step, row_images, tower_trained, vision_bytes, vision_s
from homelab_ft.plan.price.memory import gib_text
from homelab_ft.plan.price.params import (
    host_embedding_bytes,
    linears_for,
    router_params,
    trainable_params,
    vision_linears_for,
    weight_bytes,
)
from homelab_ft.plan.price.pipeline import bubble_fraction, split_text
from homelab_ft.plan.shape.shapes import ModelShape
from homelab_ft.rules.loss_chunks import AUTO, chunk_rows


def link_text(c: Cluster, *, inter: bool) -> str:
    """The link the plan assumed: bandwidth a collective gets, latency of a tiny all-reduce, and
    whether each was measured (a cluster file from `doctor`) or assumed from the link kind."""
    if inter:
        name = c.inter_link_name
        bw_measured, latency_measured = c.inter_link_measured, c.inter_latency_s is not None
        bytes_per_s, hop_s = c.inter_bytes_per_s, c.inter_hop_s
    else:
        name = "gloo" if c.device == "cpu" else c.intra_link
        bw_measured, latency_measured = c.intra_link_gbit is not None, c.intra_latency_s is not None
        bytes_per_s, hop_s = c.intra_bytes_per_s, c.intra_hop_s
    if bw_measured == latency_measured:
        how = "measured" if bw_measured else "assumed"
    else:
        how = f"{'bandwidth' if bw_measured else 'latency'} measured, {'latency' if bw_measured else 'bandwidth'} assumed"
    return f"{name} ({bytes_per_s / 1e6:.0f} MB/s, {2 * hop_s * 1000:.2f} ms all-reduce latency, {how})"


def _timed_text(r) -> str:
    """Which row length the step's seconds are priced at (memory is priced at data.max_length)."""
    if r.data.packing:
        return f"timed    rows packed to data.max_length={r.data.max_length}"
    if r.lengths is None:
        return (f"timed    rows at data.max_length={r.data.max_length} (their lengths not measured here yet: "
                "`homelab-ft data inspect` or a run measures them)")
    what = {"dpo": "pairs", "grpo": "prompts"}.get(r.objective, "rows")
    return (f"timed    micro-batches padded to ~{r.timed_prompt_tokens:.0f} tokens, the expected longest of "
            f"{r.train.micro_batch_size} of the {r.lengths.num_rows} {what} measured when the data was last prepared")


def _chunk_text(chunk_tokens: int | str, vocab_size: int) -> str:
    """`auto` with the tokens per chunk it means for this vocabulary (loss_chunks.chunk_rows)."""
    if chunk_tokens != AUTO:
        return str(chunk_tokens)
    return f"auto ({chunk_rows(chunk_tokens, vocab_size=vocab_size)} tokens)"


def lora_text(shape: ModelShape, request: PlanRequest) -> str:
    """What an adapter rung trains, from the shape's marks (lora_targets.wrapped_names: the linears
    model/targets.resolve hands PEFT; the fused expert stacks moe_experts adapts; the routers
    moe_routers finds), with the trainable count the trainer's count_params reports
    (params.trainable_params): `all-linear: self_attn.{q_proj, ...} in 48 blocks; mlp.experts.{...}
    of each of 128 experts in 48 blocks; routers frozen; N trainable parameters at r=8`."""
    targets = request.lora.targets
    all_linear = "all-linear" in targets
    blocks: dict[str, int] = {}  # what is adapted -> in how many blocks
    left_out: dict[str, None] = {}
    for block in shape.blocks:
        parents: dict[str, list[str]] = {}
        for lin in linears_for(block, targets):
            parent, _, leaf = lin.name.rpartition(".")
            parents.setdefault(parent, []).append(leaf)
        adapted = [f"{parent}.{{{', '.join(leaves)}}}" if parent else ", ".join(leaves) for parent, leaves in parents.items()]
        if all_linear and block.expert_stacks:
            names = block.expert_names or tuple(f"stack{i}" for i in range(len(block.expert_stacks)))
            experts = "/".join(str(e) for e in sorted({e for e, _, _ in block.expert_stacks}))
            adapted.append(f"{names[0].rpartition('.')[0]}.{{{', '.join(n.rpartition('.')[2] for n in names)}}} "
                           f"of each of {experts} experts")
        for what in adapted:
            blocks[what] = blocks.get(what, 0) + block.num_blocks
        left_out.update((lin.name, None) for lin in block.linears if all_linear and not lin.all_linear)
    parts = [f"{what} in {n} block{'s' * (n != 1)}" for what, n in blocks.items()] or ["nothing"]
    if left_out:
        parts.append(f"left out, as routers and Mamba projections PEFT cannot wrap: {', '.join(left_out)}")
    vision = vision_linears_for(shape, targets)
    if vision:
        leaves = dict.fromkeys(lin.name.rpartition(".")[2] for lin in vision)
        parts.append(f"vision tower: {{{', '.join(leaves)}}} in {len(vision)} layers (lora.target_modules names them)")
    if any(b.router_params for b in shape.blocks):
        parts.append(f"routers trained in full ({router_params(shape, request):,} parameters)" if request.lora.train_router
                     else "routers frozen (lora.train_router: false)")
    what = "all-linear" if all_linear else "target_modules " + ",".join(targets)
    return f"{what}: {'; '.join(parts)}; {trainable_params(shape, request):,} trainable parameters at r={request.lora.r}"


def embedding_lines(p: Plan) -> list[str]:
    """For a chosen option that keeps the input embeddings on the host (params.host_embedding_bytes):
    what stays there and what crosses PCIe instead."""
    s, r = p.shape, p.request
    table = host_embedding_bytes(s, rung=p.chosen.rung, request=r, cluster=p.cluster) if p.chosen else 0
    if not table:
        return []
    return [f"embed    the input embeddings ({gib_text(table)} GiB) stay in host RAM; the rows looked up go to the GPU, "
            f"{r.micro_batch_tokens} tokens x {s.hidden_size} per micro-batch (train.embedding_offload)"]


def pipeline_lines(p: Plan) -> list[str]:
    """For a chosen pipeline: its split over the GPUs, and why it won, with the numbers: what crosses
    each boundary, the bubble, and the fastest unpipelined option per replica's batch (Option.batch_s)."""
    o, c, r = p.chosen, p.cluster, p.request
    if o is None or not o.stages:
        return []
    stages, micro = len(o.stages), r.train.grad_accum_steps
    boundary_mb = o.comm_bytes / max(1, 2 * micro) / 1e6 if stages > 1 else 0.0
    link = c.inter_link_name if len({s.node for s in o.stages}) > 1 else (c.intra_link if c.device == "cuda" else "gloo")
    lines = [f"stages   {split_text(o.stages)}",
             f"pipeline {micro} micro-batches x {boundary_mb:.1f} MB of hidden states each way per boundary over {link}: "
             f"{o.comm_s:.1f} s/step, {o.comm_s - o.comm_hidden_s:.1f} s not hidden; bubble "
             f"{bubble_fraction(stages=stages, micro_batches=micro):.0%} of compute ({o.bubble_s:.1f} s)"]
    unpipelined = [x for x in p.options if not x.stages and x.method == o.method]
    others = [x for x in unpipelined if x.fits]
    if unpipelined and not others:
        closest = min(unpipelined, key=lambda x: max(x.memory.total / max(1, x.budget_bytes),
                                                      x.host_bytes / max(1, x.host_budget_bytes or x.host_bytes)))
        lines.append(f"why      no {o.method} option without a pipeline fits; the closest, {closest.reason}")
    if others:
        best: Option = min(others, key=lambda x: x.batch_s)
        lines.append(f"why      {o.step_s:.1f} s/step training {_batches(o)} ({o.batch_s:.1f} s per batch) vs "
                     f"{best.step_s:.1f} s/step training {_batches(best)} ({best.batch_s:.1f} s per batch) for the "
                     f"fastest without a pipeline, {best.label}, which moves {gib_text(best.comm_bytes)} GiB per rank")
    return lines


def _batches(o: Option) -> str:
    """How many micro_batch x grad_accum_steps batches one step of `o` trains: one per replica."""
    replicas = o.rung.data_parallel_size
    return f"{replicas} batch{'es' if replicas > 1 else ''}"


def image_lines(p: Plan) -> list[str]:
    """For an image-text model: what one image becomes in tokens (its size, the processor, the rows'
    images as priced) and what the vision tower costs the chosen option (price/images.py)."""
    s, r, o = p.shape, p.request, p.chosen
    if s.vision is None or r.images is None or o is None:
        return []
    v, i = s.vision, r.images
    (h, w), tokens = i.size, i.tokens_per_image
    side = math.sqrt(v.points[-1][0] * v.points[-1][1] / v.points[-1][2]) if v.dynamic else 0.0  # measured, uncapped
    geometry = f"~{side:.0f}x{side:.0f} px per token" if v.dynamic else "a fixed count per image"
    size = (f"at {w}x{h}, data.image_max_pixels" if i.bounded
            else f"at a {w}x{h} photo; data.image_max_pixels is unset")
    images, row_tokens = row_images(s, r, timed=False)
    if i.counts:
        mean_images, mean_tokens = i.mean_per_row
        rows = (f"rows as measured on {i.num_rows}: up to {images:.0f} image(s) and {row_tokens:.0f} image tokens, "
                f"{mean_images:.2f} and {mean_tokens:.0f} on average")
    else:
        rows = (f"rows priced with one image of {row_tokens:.0f} tokens"
                + ("" if i.bounded or not v.dynamic else " (unbounded, an image may fill a row)")
                + "; `data inspect` measures the rows'")
    act = activation_dtype_bytes(o.rung, r, p.cluster)
    saved, held = vision_bytes(s, rung=o.rung, request=r, act_bytes=act)
    per_step = images_per_step(s, r)
    seconds = vision_s(s, rung=o.rung, request=r, cluster=p.cluster)
    trained = tower_trained(s, rung=o.rung, request=r)
    tower = (f"vision tower {v.params / 1e9:.2f}B params, {gib_text(v.params * weight_bytes(r, p.cluster))} GiB "
             + ("with adapters (lora.target_modules names its layers)" if trained else "frozen"))
    cost = (f"its forward holds {held / 2**20:.0f} MiB for a micro-batch's images"
            + (f", {saved / 2**20:.0f} MiB of them kept for backward" if saved else "")
            + f"; +{seconds / max(per_step, 1e-9):.3f} s per image, {seconds:.2f} s a step")
    return [f"images   ~{tokens} tokens per image {size} ({v.image_processor}: {geometry}); {rows}",
            f"         {tower}; {cost}"]


def grpo_lines(p: Plan) -> list[str]:
    """For a GRPO plan's chosen option: the rollout's memory and seconds beside training's
    (plan/price/rollout.py), and which phase sets the peak."""
    o, r = p.chosen, p.request
    if o is None or o.rollout is None:
        return []
    m, g, x = o.memory, r.grpo, o.rollout
    binds = "generation" if m.generation_peak > m.training_peak else "training"
    scoring = (f" + {x.old_logprob_s:.1f} s old log-probs" if x.old_logprob_s else "") \
        + (f" + {x.reference_s:.1f} s reference" if x.reference_s else "") \
        + (f" + {x.sync_s:.2f} s adapter sync" if x.node else "")
    where = ("on the rollout node, the adapters sent each sync "
             f"({x.adapter_bytes / 2**20:.1f} MiB, ~{x.sync_s:.2f} s on the {p.cluster.inter_link_name} link)"
             if x.node else "on the training device")
    return [f"grpo     G={g.num_generations} x {r.train.micro_batch_size} prompt(s) per micro-batch, completions <= "
            f"{g.max_completion_length} tokens, generated {where}: rollout KV cache {gib_text(x.kv_cache_bytes)} GiB; peak "
            f"{gib_text(m.generation_peak)} GiB generating vs {gib_text(m.training_peak)} GiB training ({binds} binds); "
            f"~{x.generation_s:.1f} s generation{scoring} + ~{o.training_s:.1f} s training per step "
            f"(a batch sampled every {g.num_iterations} step{'s' * (g.num_iterations != 1)}; a decode step "
            f"{x.decode_step_s * 1000:.0f} ms, bound by {_bound_text(x.decode_bound, p.cluster)})"] + _node_line(p)


def _node_line(p: Plan) -> list[str]:
    """What a rollout node is and costs: waiting for the node (max_staleness 0) or overlapped with training (1)."""
    x, c, o = p.chosen.rollout, p.cluster, p.chosen
    if x.overlapped:
        return [f"         the rollout node generates the next step's batch while this one trains (grpo.max_staleness=1, "
                f"truncated importance sampling): step ~{o.step_s:.1f} s = sync + max(training "
                f"~{o.training_s + x.reference_s + x.old_logprob_s:.1f} s, generation + scoring "
                f"~{x.generation_s + x.node_logprob_s:.1f} s)"]
    if x.node:
        return ["         the rollout node generates while the trainer waits (grpo.max_staleness=0), so the step is "
                "generation + sync + training; grpo.max_staleness=1 overlaps the two"]
    if p.request.grpo.rollout == "colocated" and c.nodes == 2 and c.gpus_per_node == 1 \
            and p.request.method in ("auto", "lora", "qlora"):
        return ["         a second machine can generate instead: grpo.rollout=node (only the adapters cross the link; "
                "`homelab-ft plan ... grpo.rollout=node` prices it)"]
    return []


def _bound_text(bound: str, c: Cluster) -> str:
    """What sets a decode step's time (Rollout.decode_bound), in words."""
    if bound == "memory":
        return f"reading weights and KV cache at {c.memory_bandwidth / 1e9:.0f} GB/s"
    if bound == "compute":
        return f"compute at {c.tflops:.3g} TFLOPS"
    return "the host launching eager generate's ops"


def refused_lines(p: Plan) -> list[str]:
    """The options the ladder did not offer, one line per reason with the options it keeps off:
    `not offered: qlora pipeline 2 stages, lora pipeline 2 stages: sharding.pipeline_stages=2: objective=dpo ...`."""
    by_reason: dict[str, list[str]] = {}
    for refusal in p.refused:
        by_reason.setdefault(refusal.reason, []).append(refusal.label)
    return [f"{'refused' if i == 0 else '':8s} {', '.join(labels)}: {reason}"
            for i, (reason, labels) in enumerate(by_reason.items())]


def format_plan(p: Plan) -> str:
    """A readable table: one row per option, the chosen one marked with `>`."""
    s, c, r = p.shape, p.cluster, p.request
    params = f"{s.total_params / 1e9:.2f}B params" + (f" ({s.active_params / 1e9:.2f}B active)" if s.is_moe else "")
    if s.vision_params:
        params += f" + {s.vision_params / 1e9:.2f}B vision, frozen"
    uneven = " (per node: " + ", ".join(f"{gib_text(b)}" for b in c.node_device_bytes) + " GiB)" if c.node_device_bytes else ""
    device = (f"{c.gpus_per_node}x {gib_text(c.device_bytes)} GiB GPU{uneven}" if c.device == "cuda"
              else f"CPU, {c.gpus_per_node} process(es), {gib_text(c.device_bytes)} GiB RAM each")
    links = ""
    if c.gpus_per_node > 1:
        links += f", {link_text(c, inter=False)} inside a node"
    if c.nodes > 1:
        links += f", {link_text(c, inter=True)} between nodes"
    lines = [
        f"model    {p.model} ({s.model_type}, {params}; config: {p.config_source})",
        f"cluster  {c.nodes} node(s) x {device}, host RAM {gib_text(c.host_ram_bytes)} GiB/node{links} [{c.source}]",
        f"compute  {c.tflops_source or f'{c.tflops:.3g} TFLOPS sustained per device (as given)'}",
        f"request  method={r.method} strategy={r.sharding.strategy} seq={r.data.max_length} micro_batch={r.train.micro_batch_size} "
        f"accum={r.train.grad_accum_steps} act_ckpt={str(r.train.activation_checkpointing).lower()} loss_chunk={_chunk_text(r.train.loss_chunk_tokens, s.vocab_size)}"
        f" act_offload={str(r.train.activation_offload).lower()} emb_offload={str(r.train.embedding_offload).lower()}"
        + (" optim_in_bwd" if r.train.optimizer_in_backward else "")
        + (f" lora_dtype={r.lora.dtype}" if r.lora.dtype != "float32" else "") + f" headroom={r.planner.headroom:.0%}"
        + (f" objective=dpo ({r.rows_per_micro_batch} sequences per micro-batch"
           + ("" if r.reference_forward else f"; dpo.loss={r.dpo.loss}: no reference")
           + ("; dpo.loss=kto: no-grad forwards of the reference and of the mismatched completions (KL)"
              if r.kl_forwards else "") + ")" if r.objective == "dpo" else "")
        + (f" objective=grpo ({r.rows_per_micro_batch} sequences of <= {r.data.max_length}+{r.completion_tokens} tokens "
           "per micro-batch)" if r.objective == "grpo" else ""),
        _timed_text(r),
        "",
        "  option                                weights  grads  optim  activ  logits  gather  total  budget  host   comm/step  comm s  step s  verdict",
    ]
    for o in p.options:
        m = o.memory
        mark = ">" if o is p.chosen else " "
        verdict = ("fits" if o.fits else "no") + ("" if o.allowed else " (not requested)")
        verdict += f" (paged optimizer: {gib_text(o.spilled_bytes)} GiB in host RAM)" if o.spilled_bytes else ""
        lines.append(
            f"{mark} {o.label:37s} {gib_text(m.weights):>7} {gib_text(m.gradients):>6} {gib_text(m.optimizer):>6} "
            f"{gib_text(m.activations):>6} {gib_text(m.logits):>7} {gib_text(m.gathered):>7} {gib_text(m.total - o.spilled_bytes):>6} "
            f"{gib_text(o.budget_bytes):>7} {gib_text(o.host_bytes):>5} {gib_text(o.comm_bytes):>8}Gi {o.comm_s:>7.2f} {o.step_s:>7.2f}  {verdict}"
        )
    lines.append("  (GiB per device; host: GiB on node 0; comm s: seconds of collectives per step; "
                 "step s: compute + the communication it does not hide + offload"
                 + (" + GRPO's generation and no-grad forwards; total: the larger of generation's and training's peaks)"
                    if r.objective == "grpo" else ")"))
    lines.append("")
    if p.chosen is not None:
        lines.append(f"chosen   {p.chosen.reason}")
        if p.chosen.rung.adapters_enabled:
            lines.append(f"lora     {lora_text(s, r)}")
        lines += embedding_lines(p)
        lines += image_lines(p)
        lines += pipeline_lines(p)
        lines += grpo_lines(p)
        lines.append(f"disk     {gib_text(p.checkpoint_bytes)} GiB per checkpoint (trainable weights + optimizer state)")
        lines += [f"{'afford' if i == 0 else 'next':8s} {a.text(request=r)}" for i, a in enumerate(p.affordable)]
    else:
        lines.append(f"nothing fits; closest: {p.closest.reason}" if p.closest else "nothing fits")
        lines += [f"  would fit: {text}" for text in p.suggestions]
    rejected = [o for o in p.options if o.allowed and not o.fits]
    if p.chosen is not None and rejected:
        lines.append("rejected " + rejected[0].reason)
        lines += [f"         {o.reason}" for o in rejected[1:]]
    lines += refused_lines(p)
    if p.chosen is not None and p.chosen.prepass_s_per_pair:
        lines.append(f"dpo      the reference is scored once before step 1: ~{p.chosen.prepass_s_per_pair * 1000:.1f} s "
                     "per 1000 pairs (cached beside the tokenised data)")
    lines += [f"warning  {w}" for w in p.warnings]
    return "\n".join(lines)
