"""`train.compile`: torch.compile each transformer block in place, and the loss's cross-entropy.

Per block, as torchtitan (`distributed/compile.py`: `block.compile(...)` after activation
checkpointing, before FSDP2) and torchtune (`training.compile_model`: `m.compile()` per layer)
do, rather than the whole model: every block of a model runs the same code, so dynamo traces one
graph and reuses it for all of them (parameters are graph inputs, not constants; measured: one
graph for both blocks of the test Llama), and compile time does not grow with depth. `nn.Module.compile()` compiles the
module's call in place: the module tree, parameter names and state_dict keys stay as they are
(no `_orig_mod.` prefix), so checkpoints, PEFT adapters, DCP and export see the same model.

The order with the other wrappers, as torch 2.13 and transformers 5.x arrange it (measured here):
- activation checkpointing: transformers checkpoints a block's `forward` (modeling_layers.py), and
  `compile()` compiles the module's call, which runs `forward`: the compiled graph contains the
  checkpoint (dynamo turns it into its checkpoint higher-order op), i.e. compile around
  checkpoint, torchtitan's order. The backward graph recomputes the block's forward inside one
  compiled kernel sequence.
- FSDP2: `fully_shard`'s hooks gather the block's weights before its call and free them after;
  FSDP2 marks them `_dynamo_disable` (torch/distributed/fsdp/_fully_shard/_fsdp_state.py), so they
  run eagerly around the graph, which sees the gathered weights as ordinary inputs. Since `compile()` only sets
  an attribute used at the first call, compiling before or after `fully_shard` is the same; it is
  applied once the model is fully built (`fully_shard` renames the block class, which
  `distributed.transformer_blocks` still finds through its bases).
- LoRA (PEFT): the adapter's linear layers are ordinary modules inside the block; dropout > 0 is
  compiled to inductor's own random numbers, so a compiled run's dropout masks differ from an
  eager run's (the parity tests use dropout 0). A bitsandbytes 4-bit base (QLoRA) compiles too:
  bitsandbytes registers its kernels as torch custom ops (measured on CPU: no graph break,
  gradients within 5e-7 of eager).
- activation offload: the compiled graph saves its inputs for backward through autograd, so the
  offload's saved-tensor hooks (offload.py) still see them.

Shapes: `dynamic=None` (torch's default): the first call compiles for its exact shapes; when the
padded length changes, the block is compiled once more with symbolic shapes and serves every
length after that. The first step is therefore slow (tens of seconds per distinct graph on a
desktop CPU, mostly the C++ compiler; inductor caches the result in /tmp/torchinductor_$USER, so a
second run of the same model starts faster).

Inductor needs, on CPU, a C++ compiler and Python's headers (it builds each kernel as a Python
extension: torch/_inductor/codecache.py includes Python.h) and, on CUDA, Triton on a GPU of compute
capability >= 7.0. Without them the first step would fail deep inside torch after the model is
loaded (torch 2.13 without g++: `InductorError: InvalidCxxCompiler` at the first call; there is
no fallback to eager); `check_available` refuses the recipe before anything starts instead.
"""

from __future__ import annotations

import functools
import logging
import shutil
import sysconfig
from pathlib import Path

import torch
from torch import nn

from homelab_ft.errors import UserError

log = logging.getLogger(__name__)

BACKEND = "inductor"
_OFF = "or set train.compile=false"


def check_available(*, device_type: str) -> None:
    """Refuse `train.compile=true` where torch.compile cannot run, naming the fix (preflight)."""
    if not callable(getattr(torch, "compile", None)):
        raise UserError(f"train.compile=true needs torch.compile (torch >= 2.0; this is torch {torch.__version__}); "
                        f"upgrade torch {_OFF}")
    from torch import _dynamo

    if not _dynamo.is_dynamo_supported():
        import sys

        raise UserError(f"train.compile=true: torch {torch.__version__} cannot compile on Python "
                        f"{sys.version.split()[0]}; use a Python that this torch supports {_OFF}")
    cxx = cxx_compiler()
    if cxx is None:
        import torch._inductor.config as inductor_config

        names = " or ".join(name for name in inductor_config.cpp.cxx if name)
        raise UserError(f"train.compile=true: no C++ compiler ({names}) on PATH, which torch.compile's inductor "
                        f"needs; install one (apt install g++) or point CXX at it, {_OFF}")
    headers = Path(sysconfig.get_path("include"), "Python.h")
    if not headers.is_file():
        raise UserError(f"train.compile=true: {headers} is missing and inductor compiles its kernels against it; "
                        f"install Python's headers (apt install python3-dev) {_OFF}")
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise UserError("train.compile=true on CUDA needs Triton and a GPU of compute capability >= 7.0 "
                            f"(pip install triton, which matches the torch build) {_OFF}")


def cxx_compiler() -> str | None:
    """The first of inductor's C++ compiler names (`$CXX`, else g++) found on PATH, or None."""
    import torch._inductor.config as inductor_config

    for name in inductor_config.cpp.cxx:
        found = shutil.which(name) if name else None
        if found:
            return found
    return None


def compile_blocks(model: nn.Module, *, backend: str | None = None) -> int:
    """torch.compile every transformer block of `model` in place; returns how many.

    `backend` (default BACKEND) is for tests: `aot_eager` traces the same graphs through dynamo and
    AOTAutograd without inductor's code generation.
    """
    from homelab_ft.model.blocks import transformer_blocks

    backend = backend or BACKEND
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile(backend=backend)
    log.info("train.compile: %d transformer blocks compiled with %s (the first step includes compiling them)",
             len(blocks), backend)
    return len(blocks)


def compiled(fn):
    """`fn` compiled once per process and backend (the loss's cross-entropy: loss.py)."""
    return _compiled(fn, BACKEND)


@functools.cache
def _compiled(fn, backend: str):
    return torch.compile(fn, backend=backend)
