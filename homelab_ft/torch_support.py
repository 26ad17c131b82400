"""The torch releases homelab-ft runs on, checked once at start-up without importing torch.

TORCH_MIN is the oldest release whose source has every torch API the code calls, read from each
release's own wheel (torch/... of 2.5.0 to 2.11.0; the first release that has each):
- FSDP2 at `torch.distributed.fsdp` (`fully_shard`, `FSDPModule`, `MixedPrecisionPolicy`,
  `CPUOffloadPolicy`, `OffloadPolicy`; parallelize.py) and the methods `set_unshard_in_backward`,
  `set_requires_gradient_sync`, `unshard`, `reshard` (fsdp/_fully_shard/_fully_shard.py): 2.6
  (2.5 had them only as torch.distributed._composable.fsdp).
- DCP: `dcp.save`/`dcp.load(no_dist=True)`, `StorageMeta.load_id`, `CheckpointException`, the
  state-dict helpers with `StateDictOptions(full_state_dict, broadcast_from_rank0)`: 2.5.
- `torch.distributed.checkpoint.HuggingFaceStorageReader` (sharded_loading.py reads each rank's
  slices of the safetensors files with it): exported from 2.8 (hf_storage.py; 2.7 had only a
  private `_HuggingFaceStorageReader`). 2.8's `read_data` reads every file whole on every rank
  (`deserialize(stream.read())`), so a rank briefly holds a whole shard file, which the host-RAM
  plan does not price and which defeats loading a model no rank can hold; 2.9 reads slices
  through `safe_open` (memory-mapped). Hence 2.9.
- `torch.distributed.tensor.DTensor`: 2.5; `torch.distributed.pipelining` (`PipelineStage`,
  `Schedule1F1B`, `ScheduleGPipe`): 2.4; `torch.compile`/`nn.Module.compile`,
  `torch._inductor.config.cpp.cxx`, `torch.utils._triton.has_triton`, `_dynamo.is_dynamo_supported`:
  all present in 2.5.
Only (major, minor) is compared: vendor builds carry pre-release tags of the release they track
(NVIDIA's containers ship `2.9.0a0+<hash>.nv25.10`), which PEP 440 orders below 2.9.0.
"""

from __future__ import annotations

import re
from importlib import metadata

from homelab_ft.errors import UserError

TORCH_MIN = (2, 9)
"""Oldest supported torch release (see the module docstring); pyproject.toml's `torch>=` says the same."""


class TorchTooOld(UserError):
    """The installed torch predates TORCH_MIN."""


def installed_torch() -> str | None:
    """The installed torch's version string (from its metadata, torch not imported), or None."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.11.0+cu130" -> (2, 11)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if not found:
        raise ValueError(f"not a torch version: {version!r}")
    return int(found.group(1)), int(found.group(2))


def check_torch(version: str | None = None) -> None:
    """Refuse a torch older than TORCH_MIN in one line; no torch at all is left to the commands
    that need it (`plan` does not)."""
    version = installed_torch() if version is None else version
    if version is None or release(version) >= TORCH_MIN:
        return
    need = ".".join(map(str, TORCH_MIN))
    raise TorchTooOld(f"torch {version} is installed; homelab-ft needs torch >= {need} (FSDP2, DCP and "
                      f"the safetensors slice reader as they are in {need}); install torch >= {need} "
                      f"built for this machine's CUDA or ROCm")
