import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The planner caches derived model shapes (plan/shape_cache.py); tests (and the processes they start)
# write theirs into a folder of this session's, never into the user's ~/.cache.
if "HOMELAB_FT_CACHE" not in os.environ:
    import tempfile

    os.environ["HOMELAB_FT_CACHE"] = tempfile.mkdtemp(prefix="homelab-ft-test-cache-")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama + ChatML tokenizer on disk (built once per test session)."""
    from tiny import make_llama

    return make_llama(tmp_path_factory.mktemp("tiny-llama"))
