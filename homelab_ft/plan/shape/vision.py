"""What an image costs an image-text model's vision side, measured: the image tokens it becomes, the
bytes the tower keeps for backward when it trains, the most bytes its frozen forward holds at once,
and its FLOPs.

The vision side (tower and projector) is run the way the model's own forward runs it on a batch's
images: `get_image_features`, on what the model's image processor makes of a blank image (its
`pixel_values`, and `image_grid_thw`, `pixel_attention_mask` or `image_sizes` where the family has
them). Its output rows are the image tokens the language model's sequence carries for that image,
the count the processor expands the image placeholder to and the model's own check accepts
(tests/unit/plan/shape/test_image_tokens.py), so no per-family formula is written here: Qwen2-VL's
(h/28)*(w/28) after its smart resize, SmolVLM's tiles of a fixed count, Gemma 3's fixed 256 all come
out of transformers' own code.

The parameters are on the meta device, as derive.py builds them, but the vision side computes from
its inputs' values (Qwen2-VL's patch grid decides rotary positions and attention windows through
`repeat_interleave` and `tolist`; SmolVLM drops padding tiles by value; Pixtral splits its output by
image size), which neither saved.py's meta tensors nor its FakeTensorMode can run. So
`_RealUntilWeights` runs every op whose inputs are all real (the processor's tensors and what is
computed from them alone) for real on the CPU, and an op that meets a parameter (or anything
computed from one) on meta, its real inputs converted once each. The image processor comes from the model folder (preprocessor_config.json,
processor_config.json), else it is transformers' default for the family; torchvision is never needed
(the PIL backend).

Three images give each quantity as c + a*T + b*T^2 in the image tokens T (types.VisionShape), for
both activation dtypes, and two images in one call what a batch's images cost together beyond each
alone (x*T^2 per pair). Where every image gives the same T (a fixed count per image: Gemma 3, Llava,
PaliGemma), the one measured cost is per image. The saved bytes use saved.py's stand-ins (SDPA keeps
what the fused kernels keep); the FLOPs are torch.utils.flop_counter's. Bytes are measured with a
block or two of each kind running and the others passing their input through (`_costs` says why
that holds). A family whose vision side branches on its activations' values cannot be run this way:
its shape says so (`unmeasured`) and only its weights are priced.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from pathlib import Path

from homelab_ft.plan.shape.types import Linear, VisionShape
from homelab_ft.rules.image_area import processor_kwargs

log = logging.getLogger(__name__)

SIDES = (112, 224, 336)
"""Square images measured, in pixels per side: three image-token counts for a family whose count
grows with the image (Qwen2-VL: 16, 64 and 144 tokens), below every processor's own limit, and the
middle one twice in one call (two images: what a batch's images cost together beyond each alone)."""
DTYPES = {2: "bfloat16", 4: "float32"}
"""Activation bytes per element -> the dtype the vision side runs in to measure it (saved.DTYPES)."""
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
"""Where a checkpoint keeps its image processor's settings (transformers writes either)."""


def measure_vision(build, *, model_path: str | None) -> VisionShape:
    """The vision side of the image-text model `build(dtype)` returns on the meta device, measured on
    images its image processor prepares (see the module docstring)."""
    import torch

    from homelab_ft.rules import vision

    model = build(None)
    prefixes = vision.vision_prefixes(model)
    params = vision.vision_param_count(model)
    linears = tuple(Linear(name, m.in_features, m.out_features, m.bias is not None, all_linear=False)
                    for name, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear) and vision.is_vision_module(name, prefixes))
    try:
        processor = image_processor(model.config, model_path=model_path)
    except Exception as err:  # noqa: BLE001 - no image processor for the family: its weights are still priced
        return VisionShape(params=params, linears=linears, unmeasured=f"no image processor to prepare images ({_said(err)})")
    try:
        return _measured(build, processor, params=params, linears=linears)
    except Exception as err:  # noqa: BLE001 - a vision side that branches on its activations' values
        log.debug("the vision side of %s could not run on the meta device: %r", type(model).__name__, err)
        return VisionShape(params=params, image_processor=type(processor).__name__, linears=linears,
                           unmeasured=f"its vision side did not run on the meta device ({_said(err)})")


def _said(err: Exception) -> str:
    """An error in a few words for the plan's warning: its type and its first line."""
    first = str(err).splitlines()[0][:200] if str(err) else ""
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def image_processor(config, *, model_path: str | None):
    """The checkpoint's image processor (PIL backend): from its folder's processor files, else
    transformers' default for the model type."""
    from transformers import AutoImageProcessor
    from transformers.models.auto.image_processing_auto import (
        IMAGE_PROCESSOR_MAPPING_NAMES,
        get_image_processor_class_from_name,
    )

    folder = processor_folder(model_path)
    if folder is not None:
        return AutoImageProcessor.from_pretrained(folder, backend="pil")
    names = IMAGE_PROCESSOR_MAPPING_NAMES[config.model_type]
    return get_image_processor_class_from_name(names.get("pil") or next(iter(names.values())))()


def processor_folder(model_path: str | None) -> Path | None:
    """The folder holding the checkpoint's processor files (locate.py: the model folder, a cached
    hub snapshot, or the folder of a config.json given as the model path); None when there are none."""
    from homelab_ft.errors import UserError
    from homelab_ft.locate import locate

    if not model_path:
        return None
    try:
        where = locate(model_path)
    except UserError:
        return None
    folder = where.path if where.kind in ("folder", "hub") else where.path.parent if where.kind == "config" else None
    return folder if folder and any((folder / name).is_file() for name in PROCESSOR_FILES) else None


def processor_files(model_path: str | None) -> list[str]:
    """The texts of the checkpoint's processor files (the shape cache keys on them)."""
    folder = processor_folder(model_path)
    return [(folder / name).read_text() for name in PROCESSOR_FILES if folder and (folder / name).is_file()]


class _CutFailed(Exception):
    """The tower does not run with blocks passed through (`_only`): it is measured whole."""


def _measured(build, processor, *, params: int, linears: tuple[Linear, ...]) -> VisionShape:
    models = {act_bytes: build(_dtype(dtype)) for act_bytes, dtype in DTYPES.items()}
    try:
        return _measured_as(models, processor, block_kinds(models[4]), params=params, linears=linears)
    except _CutFailed as err:
        log.debug("measuring the whole vision tower: %s", err)
        whole = [[index] for index in range(len(vision_blocks(models[4])))]
        return _measured_as(models, processor, whole, params=params, linears=linears)


def _measured_as(models: dict, processor, kinds: list[list[int]], *, params: int,
                 linears: tuple[Linear, ...]) -> VisionShape:
    # the tower's costs, not the processor's saved cap: a processor that takes pixel bounds at call time
    # (rules/image_area.py, as a recipe's data.image_max_pixels gives them) reads each image at its size
    bounds = processor_kwargs(processor, max_pixels=2 * SIDES[-1] ** 2, min_pixels=SIDES[0] ** 2 // 2)
    points, costs = [], []
    for side in SIDES:
        inputs = vision_inputs(models[4], processor, height=side, width=side, bounds=bounds)
        tokens, measured = _costs(models, inputs, kinds)
        points.append((side, side, tokens))
        costs.append(measured)
    pair_tokens, pair = _costs(models, vision_inputs(models[4], processor, height=SIDES[1], width=SIDES[1], images=2,
                                                     bounds=bounds), kinds)
    counts = [t for _, _, t in points]

    def coefficients(key) -> tuple[float, float, float, float]:
        c, a, b = fit(counts, [cost[key] for cost in costs])
        one = points[1][2]
        # two images in one call: what they cost beyond twice one image, per ordered pair (VisionShape)
        cross = (pair[key] - 2 * (c + a * one + b * one * one)) / (2 * one * one) if pair_tokens == 2 * one else 0.0
        return c, a, b, max(0.0, cross)

    return VisionShape(
        params=params, image_processor=type(processor).__name__, points=tuple(points),
        saved=tuple((n, *coefficients(("saved", n))) for n in DTYPES),
        transient=tuple((n, *coefficients(("transient", n))) for n in DTYPES),
        flops=coefficients("flops"), linears=linears)


def _costs(models: dict, inputs: dict, kinds: list[list[int]]) -> tuple[int, dict]:
    """(image tokens, {("saved" | "transient", act bytes): bytes, "flops": FLOPs}) of one call.

    The FLOPs are counted over the whole tower. The bytes are measured with a block or two of each
    kind running and the rest passed through (`_only`: a tower of 27-32 equal blocks runs in a second,
    not a minute, every op of it on the meta device costing ~1 ms of Python). What a block keeps for
    backward is what a second block of its kind adds, times the blocks of the kind but the first. The
    most bytes held at once is what the first two and the last of each kind hold: the blocks run one
    after another, each on the last's output, so a deeper tower holds no more, but a single block
    leaves out the moment a block's output and the embeddings' are both alive, and only the last one
    runs beside every feature kept on the way (Qwen3-VL's deepstack mergers); tests/tiny_vlm.py's
    9 families at depths 2 to 4 hold what the whole tower holds. A tower whose passed-through run
    returns another token count is measured whole."""
    tokens, flops = _flops(models[4], inputs)
    costs: dict = {"flops": flops}
    for act_bytes, model in models.items():
        blocks = vision_blocks(model)
        firsts = {members[0] for members in kinds}
        with _only(blocks, firsts, kinds):
            cut, saved = _saved(model, inputs)
        if cut != tokens:
            raise _CutFailed(f"{cut} image tokens with one block of each kind, {tokens} whole")
        costs["saved", act_bytes] = saved
        for members in kinds:
            if len(members) > 1:
                with _only(blocks, firsts | {members[1]}, kinds):
                    costs["saved", act_bytes] += (len(members) - 1) * (_saved(model, inputs)[1] - saved)
        with _only(blocks, {i for members in kinds for i in (*members[:2], members[-1])}, kinds):
            costs["transient", act_bytes] = _peak(model, inputs)
    return tokens, costs


def vision_blocks(model) -> list:
    """The vision side's blocks: rules/decoder_blocks.py's (`_no_split_modules`) inside it."""
    from homelab_ft.rules import vision
    from homelab_ft.rules.decoder_blocks import decoder_blocks

    prefixes = vision.vision_prefixes(model)
    inside = {id(m) for p in prefixes for m in model.get_submodule(p).modules()}
    return [block for block in decoder_blocks(model) if id(block) in inside]


def block_kinds(model) -> list[list[int]]:
    """Indices into `vision_blocks` of blocks of one class and equal parameters, in order."""
    kinds: dict[tuple, list[int]] = {}
    for index, block in enumerate(vision_blocks(model)):
        key = (type(block).__name__, tuple((n, tuple(p.shape)) for n, p in block.named_parameters()))
        kinds.setdefault(key, []).append(index)
    return list(kinds.values())


@contextlib.contextmanager
def _only(blocks: list, kept: set[int], kinds: list[list[int]]):
    """Every block but `kept` passes its hidden states through, answering in the form the kept block of
    its kind answered (a tensor, or a tuple whose first item is the hidden states)."""
    kind_of = {index: n for n, members in enumerate(kinds) for index in members}
    answers: dict[int, object] = {}

    def recorder(kind: int):
        def record(module, args, output):
            # the answer's form, never its tensors: holding them would lengthen their lives
            if isinstance(output, tuple):
                answers[kind] = tuple(None if hasattr(item, "shape") else item for item in output[1:])
            elif hasattr(output, "shape"):
                answers[kind] = None
            else:
                raise _CutFailed(f"a block answers {type(output).__name__}")
        return record

    def passthrough(kind: int):
        def forward(*args, **kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            rest = answers[kind]
            return hidden if rest is None else (hidden, *rest)
        return forward

    handles = [blocks[i].register_forward_hook(recorder(kind_of[i])) for i in kept]
    for index, block in enumerate(blocks):
        if index not in kept:
            block.forward = passthrough(kind_of[index])
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for index, block in enumerate(blocks):
            if index not in kept:
                del block.forward


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def vision_inputs(model, processor, *, height: int, width: int, images: int = 1, bounds: dict | None = None) -> dict:
    """What the image processor makes of `images` blank `height` x `width` RGB images, kept to the
    arguments the model's `get_image_features` takes; `bounds`: the recipe's pixel bounds as the
    processor takes them at call time (rules/image_area.processor_kwargs, as the data side passes them)."""
    from PIL import Image

    prepared = processor(images=[Image.new("RGB", (width, height))] * images, return_tensors="pt", **(bounds or {}))
    accepted = inspect.signature(model.get_image_features).parameters
    return {key: value for key, value in prepared.items() if key in accepted}


def image_tokens(model, inputs: dict) -> int:
    """Image tokens the vision side returns for `inputs`: the rows of its image features."""
    with _RealUntilWeights(), _no_grad():
        return _rows(model.get_image_features(**inputs))


def _rows(output) -> int:
    features = getattr(output, "pooler_output", None)
    if features is None:
        features = output[0] if isinstance(output, tuple) else output
    if isinstance(features, (list, tuple)):
        return sum(f.numel() // f.shape[-1] for f in features)
    return features.numel() // features.shape[-1]


@contextlib.contextmanager
def _no_grad():
    import torch

    with torch.no_grad():
        yield


def _saved(model, inputs: dict) -> tuple[int, int]:
    """(image tokens, bytes autograd saves) for one forward of the vision side with every parameter
    trainable: each saved tensor counted once through its storage, parameters and inputs left out."""
    import torch

    from homelab_ft.plan.shape.saved import _Stand_ins

    for p in model.parameters():
        p.requires_grad_(True)
    skip = {_storage_id(t) for t in (*model.parameters(), *model.buffers(), *inputs.values())}
    seen: set[int] = set()
    keep: list = []
    total = [0]

    def pack(t):
        keep.append(t)
        key = _storage_id(t)
        if key not in skip and key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    with _RealUntilWeights(), _Stand_ins(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tokens = _rows(model.get_image_features(**inputs))
    return tokens, total[0]


def _peak(model, inputs: dict) -> int:
    """The most bytes the vision side's no-grad forward holds at once, parameters and inputs aside."""
    from homelab_ft.plan.shape.saved import _Stand_ins

    mode = _RealUntilWeights(track=True)
    with mode, _Stand_ins(), _no_grad():
        output = model.get_image_features(**inputs)
    del output
    return mode.peak


def _flops(model, inputs: dict) -> tuple[int, float]:
    """(image tokens, FLOPs) of one no-grad forward of the whole vision side."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with _RealUntilWeights(), counter, _no_grad():
        tokens = _rows(model.get_image_features(**inputs))
    return tokens, float(counter.get_total_flops())


def _storage_id(t) -> int:
    return t.untyped_storage()._cdata


def fit(tokens: list[int], values: list[float]) -> tuple[float, float, float]:
    """(c, a, b) of value = c + a*T + b*T^2 through the measured points: a parabola through three
    distinct counts (a line where it would bend down: a chunked kernel's padding), a line through two,
    and a cost per token where every image gave the same count."""
    points = sorted(dict(zip(tokens, values, strict=True)).items())
    if len(points) == 1 or points[0][0] == 0:
        t, v = points[-1]
        return 0.0, v / max(t, 1), 0.0
    if len(points) == 3:
        (t1, v1), (t2, v2), (t3, v3) = points
        d1, d2 = (v2 - v1) / (t2 - t1), (v3 - v2) / (t3 - t2)
        b = (d2 - d1) / (t3 - t1)
        if b >= 0:
            a = d1 - b * (t1 + t2)
            return v1 - a * t1 - b * t1 * t1, a, b
    (t1, v1), (t2, v2) = points[0], points[-1]
    a = (v2 - v1) / (t2 - t1)
    return v1 - a * t1, a, 0.0


def _RealUntilWeights(*, track: bool = False):
    """A TorchDispatchMode running ops on real tensors for real until they meet a meta tensor (a
    parameter, a buffer or what was computed from one); see the module docstring. A factory op with
    no tensor input that asks for the meta device (`torch.arange(n, device=x.device)`) and a real
    tensor copied to it stay real, so index and mask arithmetic keeps its values. With `track`, it
    also follows the bytes the ops' new storages hold while they live (`peak`)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves, tree_map

    meta = torch.device("meta")

    class Mode(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.converted: dict[int, tuple] = {}
            self.live = self.peak = 0

        def _to_meta(self, t):
            if not isinstance(t, torch.Tensor) or t.is_meta:
                return t
            if id(t) not in self.converted:  # one meta copy per real tensor, kept with it
                self.converted[id(t)] = (t, t.to(meta))
            return self.converted[id(t)][1]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if any(t.is_meta for t in tensors):
                args, kwargs = tree_map(self._to_meta, (args, kwargs))
            elif kwargs.get("device") == meta:
                kwargs = {**kwargs, "device": torch.device("cpu")}
            out = func(*args, **kwargs)
            if track:
                self._follow(out, tensors)
            return out

        def _follow(self, out, inputs) -> None:
            known = {_storage_id(t) for t in inputs}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and _storage_id(t) not in known:
                    storage = t.untyped_storage()
                    known.add(storage._cdata)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, storage.nbytes())

        def _free(self, nbytes: int) -> None:
            self.live -= nbytes

    return Mode()
