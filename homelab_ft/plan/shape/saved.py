"""What a decoder block keeps for backward, measured: one forward of the model transformers built
on the meta device (shapes, dtypes and views as on the CPU, no storage), run on its meta tensors,
or under FakeTensorMode where an op needs values (ATTEMPTS), with
`torch.autograd.graph.saved_tensors_hooks` counting every tensor autograd saves while each block
runs (parameters and tensors the block was handed, such as the rotary tables every block shares,
excluded; a view counted once, through its base). It runs twice: with every parameter requiring
grad (the full fine-tune's saved set) and with the base frozen (LoRA's and QLoRA's: a frozen
linear keeps no input for a weight gradient and a frozen norm weight no normalised copy; pricing
LoRA from the full set over-planned by 7-15%, bench/memory.py --family). The frozen pass also
records which linear layers share one input that it does not already keep (q/k/v, gate/up): the
tensor a LoRA adapter's lora_A saves, priced per targeted group by activations.py.

Three sequence lengths give bytes = c + a*seq + b*seq^2 (b: attention that materialises seq x seq
scores or a sliding-window mask). Both activation dtypes are measured: an fp32 HF RMSNorm saves
its input itself, a 16-bit one an fp32 copy of it.

SDPA dispatches to the math kernel on fake/meta tensors (which saves the seq x seq probabilities,
in fp32); a training step runs the flash or memory-efficient kernel, which saves q, k, v, the
output and a per-head log-sum-exp, so under measurement SDPA is replaced by a stand-in saving
exactly those (`_Stand_ins`); tests/unit/plan/shape/test_shapes.py checks the result against the same
hooks on a real CPU forward of every family in tests/families.py. HOMELAB_FT_DEBUG_SAVED=1 logs
each saved tensor.
"""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger(__name__)
DEBUG = os.environ.get("HOMELAB_FT_DEBUG_SAVED") == "1"

SEQ_LENS = (64, 128, 256)
"""The sequence lengths measured: three separate a block's constant bytes (a scalar it saves), the
bytes per token and the seq x seq bytes (bytes = c + a*seq + b*seq^2, exact for a transformer block)."""
DTYPES = {2: "bfloat16", 4: "float32"}
"""Activation bytes per element -> the dtype the forward runs in to measure it."""


ATTEMPTS = ((True, False), (True, True), (False, False), (False, True))
"""(cut, fake) in the order tried: one block per kind before every block, plain meta tensors before
FakeTensorMode. A forward on meta tensors runs each op's meta kernel straight from the dispatcher;
FakeTensorMode routes every op through Python (~0.2 ms an op) but runs what meta tensors refuse (an
op that needs values, a data-dependent check transformers skips only for fake tensors). Every family
in tests/families.py and every config in tests/configs runs on meta tensors, with the shapes
FakeTensorMode gave to the byte, derived in 21.5 CPU s instead of 36.9; test_shapes.py checks that
a forward meta tensors refuse falls back and measures the same."""


def measure_saved(build, firsts: list[int], *, attempts=ATTEMPTS) -> dict[int, dict]:
    """{block index: {"saved": rows, "saved_frozen": rows, "lora_inputs": groups}} for the blocks
    `firsts`, rows ((act_bytes, a, b), ...): bytes per token a + b * seq, with every parameter
    trainable and with the base frozen; groups: the names of the linear layers sharing one input
    that the frozen block does not keep. `build(dtype)` returns a fresh meta-device model in that
    dtype and its decoder blocks; each of `attempts` (ATTEMPTS) that fails gets a fresh one, and a
model whose blocks cannot be cut is not cut again in the second dtype."""
    import torch

    out: dict[int, dict] = {index: {"saved": [], "saved_frozen": []} for index in firsts}
    tries = list(attempts)
    for act_bytes, dtype in DTYPES.items():
        runs, tries = _first_run(build, getattr(torch, dtype), firsts, tries)
        for frozen, key in ((False, "saved"), (True, "saved_frozen")):
            points, positions, groups = runs[frozen]
            for n, index in enumerate(firsts):
                a, b = _per_token_fit([p.get(positions[n], 0) for p in points])
                out[index][key].append((act_bytes, a, b))
                if frozen and act_bytes == 2:
                    out[index]["lora_inputs"] = groups.get(positions[n], ())
    return {index: {k: tuple(v) for k, v in rows.items()} for index, rows in out.items()}


class _CutRefused(Exception):
    """The model's block list could not be cut to one block per kind: its layout or config refused
    (Falcon-H1's read-only `layers_block_type`), not an op, so no attempt that cuts can run."""


def _first_run(build, dtype, firsts: list[int], tries: list[tuple[bool, bool]]) -> tuple[dict, list]:
    """(runs, tries): `_measure` by the first of `tries` that runs (the last one's error if none does),
    and the tries for the next dtype: all of them, less those that cut once cutting was refused."""
    refused, error = False, None
    for cut, fake in tries:
        if cut and refused:
            continue
        try:
            return _measure(build, dtype, firsts, cut=cut, fake=fake), [t for t in tries if not (refused and t[0])]
        except _CutRefused as err:
            refused, error = True, err.__cause__
            log.debug("one block per kind could not be kept (%s): measuring every block", error)
        except Exception as err:  # noqa: BLE001 - any failure of the forward: the next, more general attempt
            error = err
            log.debug("the %s forward on %s did not run (%s): trying the next way",
                      "fake" if fake else "meta", "one block per kind" if cut else "every block", err)
    raise error


def _measure(build, dtype, firsts: list[int], *, cut: bool, fake: bool) -> dict[bool, tuple]:
    """{frozen: (points, positions, groups)}: the model in `dtype` measured with every parameter
    trainable, then with the base frozen. One model (and with `fake`, one FakeTensorMode, whose cache
    of op results answers some of the frozen pass's ops) serves both."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, blocks = build(dtype)
    kept, positions = blocks, list(firsts)
    if cut:
        try:
            kept, positions = _keep_only(model, blocks, firsts)
        except Exception as err:  # noqa: BLE001 - whatever the model's layout raised
            raise _CutRefused from err
    runs = {}
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with mode, training_masks(), _Stand_ins():
        if fake:
            model._apply(mode.from_tensor)
        for frozen in (False, True):
            if frozen:
                _freeze_base(model)
            groups: dict[int, tuple] = {}
            points = [_saved_by_block(model, kept, seq, lora_inputs=groups if frozen else None) for seq in SEQ_LENS]
            runs[frozen] = (points, positions, groups)
    return runs


def _freeze_base(model) -> None:
    """The base as LoRA trains it: no parameter requires grad, while the hidden states do (the
    adapters of earlier blocks make them), so every block's ops run as between two adapters."""
    for p in model.parameters():
        p.requires_grad_(False)
    model.get_input_embeddings().register_forward_hook(lambda module, args, output: output.requires_grad_())


def _per_token_fit(totals: list[int]) -> tuple[float, float]:
    """(a, b) of bytes = c + a*seq + b*seq^2 through the three measured points; the constant c (a
    few scalars per block) is left out: per token it vanishes at any real sequence length."""
    (s1, s2, s3), (y1, y2, y3) = SEQ_LENS, totals
    d1, d2 = (y2 - y1) / (s2 - s1), (y3 - y2) / (s3 - s2)
    b = (d2 - d1) / (s3 - s1)
    if b < 0:  # chunked kernels (linear attention) pad to whole chunks: the longest run is the rate
        return round(y3 / s3, 3), 0.0
    a = d1 - b * (s1 + s2)
    return round(a, 3), round(b, 6)


def _keep_only(model, blocks: list, firsts: list[int]) -> tuple[list, list[int]]:
    """Run only one block of each kind: the model's block list cut down to `firsts` (a 70B model's
    80 blocks under FakeTensorMode take ~10 s a forward; one per kind, well under a second). Each
    block keeps its own layer index and type attributes, which its forward reads."""
    import torch

    holder = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and any(c is blocks[0] for c in m))
    kept = [blocks[i] for i in firsts]
    if all(any(c is b for c in holder) for b in blocks):
        holder._modules.clear()
        for position, block in enumerate(kept):
            holder._modules[str(position)] = block
        config = model.config.get_text_config(decoder=True)  # an image-text model's language model's
        layer_types = getattr(config, "layer_types", None)
        if isinstance(layer_types, list) and len(layer_types) == len(blocks):
            config.layer_types = [layer_types[i] for i in firsts]
        return kept, list(range(len(kept)))
    return blocks, list(firsts)


@contextlib.contextmanager
def training_masks():
    """Masks as an unpacked training row gets them. transformers skips the causal mask (SDPA then
    runs `is_causal` with the grouped k and v) unless a sliding window is shorter than the sequence
    (masking_utils._ignore_causal_mask_sdpa); under FakeTensorMode it cannot read the position ids
    (find_packed_sequence_indices) or the cache offset, so it would always build the mask. A row of
    positions 0..n-1 is one sequence, and a training forward has no cache: offset 0."""
    import torch
    from transformers import masking_utils

    ignore_original = masking_utils._ignore_causal_mask_sdpa
    packed_original = masking_utils.find_packed_sequence_indices

    def ignore(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        q_offset = 0 if isinstance(q_offset, torch.Tensor) else q_offset
        return ignore_original(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)

    masking_utils._ignore_causal_mask_sdpa = ignore
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = ignore_original
        masking_utils.find_packed_sequence_indices = packed_original


def _saved_by_block(model, blocks: list, seq: int, *, lora_inputs: dict | None = None) -> dict[int, int]:
    """Bytes autograd saves during each block's forward, for one row of `seq` tokens. With
    `lora_inputs` (a dict), also fills {block: groups of linear names sharing an input not saved}."""
    import torch

    params = {id(p) for p in model.parameters()}
    current: list = [None, set()]
    seen: dict[int, set[int]] = {}
    keep: list = []
    totals: dict[int, int] = {}

    def before(module, args, kwargs):
        current[0] = blocks_index[id(module)]
        current[1] = {id(t) for t in _tensors((args, kwargs)) if not t.requires_grad}

    def after(module, args, kwargs, output):
        current[0] = None

    def pack(t):
        index = current[0]
        if index is None:
            return t
        root = t
        while root._base is not None:
            root = root._base
        keep.append(root)  # ids stay unique while the forward runs
        key = id(root)
        if key in params or key in current[1] or key in seen.setdefault(index, set()):
            return t
        seen[index].add(key)
        totals[index] = totals.get(index, 0) + root.untyped_storage().nbytes()
        if DEBUG:
            log.warning("block %d saves %s %s", index, tuple(root.shape), root.dtype)
        return t

    blocks_index = {id(b): i for i, b in enumerate(blocks)}
    handles = [h for b in blocks for h in (b.register_forward_pre_hook(before, with_kwargs=True),
                                            b.register_forward_hook(after, with_kwargs=True))]
    inputs: dict[int, dict[int, list[str]]] = {}
    if lora_inputs is not None:
        for index, block in enumerate(blocks):
            for name, module in block.named_modules():
                if isinstance(module, torch.nn.Linear):
                    handles.append(module.register_forward_pre_hook(_input_recorder(inputs.setdefault(index, {}), name, keep)))
    ids = torch.zeros((1, seq), dtype=torch.long, device=model.get_input_embeddings().weight.device)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    if lora_inputs is not None:
        lora_inputs.update({index: tuple(tuple(names) for root, names in by_root.items() if root not in seen.get(index, ()))
                            for index, by_root in inputs.items()})
    return totals


def _input_recorder(by_root: dict[int, list[str]], name: str, keep: list):
    """A forward pre-hook filing linear `name` under the base tensor of its input."""

    def record(module, args):
        root = args[0]
        while root._base is not None:
            root = root._base
        keep.append(root)
        names = by_root.setdefault(id(root), [])
        if name not in names:
            names.append(name)

    return record


def _tensors(tree):
    import torch

    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def _Stand_ins():
    """A TorchFunctionMode that runs SDPA as `FusedAttention` and an fp32 grouped matmul (MoE experts,
    whose meta kernel accepts only bf16) as `GroupedMm`: each saves what the real kernel saves."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class FusedAttention(torch.autograd.Function):
        """The flash / memory-efficient kernels save q, k, v, out and an fp32 log-sum-exp per head,
        and the attention bias when there is one: a boolean mask (sliding windows) converted to an
        additive one in q's dtype, one per call. Their output is laid out (batch, seq, heads, dim) and
        returned transposed, so the model's `transpose(1, 2).contiguous()` before o_proj is a view."""

        @staticmethod
        def forward(ctx, q, k, v, mask):
            batch, heads, seq = q.shape[:-1]
            out = q.new_empty((batch, seq, heads, v.shape[-1])).transpose(1, 2)
            lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
            bias = () if mask is None else (q.new_empty(mask.shape) if mask.dtype == torch.bool else mask,)
            ctx.save_for_backward(q, k, v, out, lse, *bias)
            return out

        @staticmethod
        def backward(ctx, grad):
            q, k, v = ctx.saved_tensors[:3]
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None

    class GroupedMm(torch.autograd.Function):
        """torch._grouped_mm's backward keeps each operand where the other's gradient needs it, and
        the offsets (derivatives.yaml): frozen experts keep no routed tokens."""

        @staticmethod
        def forward(ctx, a, b, offs):
            need_a, need_b = ctx.needs_input_grad[:2]
            ctx.save_for_backward(a if need_b else None, b if need_a else None, offs)
            ctx.shapes = (a, b)
            return a.new_empty(a.shape[:-1] + (b.shape[-1],))

        @staticmethod
        def backward(ctx, grad):
            a, b = ctx.shapes
            return torch.zeros_like(a), torch.zeros_like(b), None

    grouped = {f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f is not None}

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
                return FusedAttention.apply(*args[:3], mask)
            if func in grouped and args[0].dtype != torch.bfloat16:
                return GroupedMm.apply(args[0], args[1], kwargs.get("offs", args[2] if len(args) > 2 else None))
            return func(*args, **kwargs)

    return Mode()
