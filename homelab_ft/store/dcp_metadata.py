"""Read a DCP checkpoint's metadata without running code from the run directory.

torch.distributed.checkpoint stores its index (`state/.metadata`) as a pickle, and torch 2.13's
`FileSystemReader.read_metadata` calls a plain `pickle.load` on it: a planted `.metadata` runs
whatever it names on `train --resume` or `export`. Checkpoints come from disks that are shared,
copied between machines and downloaded, so the index is read here with an unpickler that admits
only the classes DCP itself writes into it (listed from the pickles that torch 2.13 writes for
LoRA, FSDP2 and DDP runs) and refuses everything else before it is called.

The tensor data itself is read by DCP with `torch.load(weights_only=True)` already.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # maps "torch.strided" to the layout object, nothing else
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
    "collections": {"OrderedDict"},
}


class UnsafeMetadata(Exception):
    """The metadata names something DCP never writes there (or is not a DCP index at all)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        raise UnsafeMetadata(f"it refers to {module}.{name}, which a DCP checkpoint index never holds")


def load_metadata(stream) -> Metadata:
    """Unpickle a DCP index from a binary stream, admitting only DCP's own types."""
    try:
        metadata = _MetadataUnpickler(stream).load()
    except UnsafeMetadata:
        raise
    except Exception as err:  # truncated or garbage bytes raise anything from EOFError to KeyError
        raise UnsafeMetadata(f"it is not a readable DCP index ({type(err).__name__}: {str(err)[:80]})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeMetadata(f"it holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


def read_metadata(state_dir: Path) -> Metadata:
    with open(Path(state_dir) / ".metadata", "rb") as fh:
        return load_metadata(io.BufferedReader(fh))


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the index read by `load_metadata` instead of `pickle.load`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as fh:
            metadata = load_metadata(fh)
        # What the parent does after unpickling (torch 2.13 filesystem.py).
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
