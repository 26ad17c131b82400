import functools
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The planner caches derived model shapes (plan/shape/cache.py); tests (and the processes they start)
# write theirs into a folder of this session's, never into the user's ~/.cache.
_OWN_CACHE: str | None = None
"""The cache folder this process made (xdist workers inherit it and leave it alone); removed at the end."""
if "HOMELAB_FT_CACHE" not in os.environ:
    import tempfile

    _OWN_CACHE = os.environ["HOMELAB_FT_CACHE"] = tempfile.mkdtemp(prefix="homelab-ft-test-cache-")

TEST_CPU_GFLOPS_PER_CORE = 100.0
"""The CPU matmul rate every test's plan is priced with: written into the session's cache as this
machine's measurement (plan/hardware.py: cpu_matmul_gflops), so no CPU plan in a test depends on how
fast, or how busy, the machine running it is."""


def _seed_cpu_speed() -> None:
    import json

    from homelab_ft.plan.hardware import cpu_speed_path

    path = cpu_speed_path()
    if not path.exists():  # a worker of this session, or a cache the caller set, may hold one already
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"gflops_per_core": TEST_CPU_GFLOPS_PER_CORE}))


_seed_cpu_speed()


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        import shutil

        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def vlm_folders(tmp_path_factory) -> dict[str, Path]:
    """model_type -> a tiny random image-text checkpoint of tiny_vlm.UNIT_FAMILIES, saved once per
    test session: the planner's image tests only read them."""
    from tiny_vlm import UNIT_FAMILIES, save_families

    return save_families(tmp_path_factory.mktemp("vlm-families"), UNIT_FAMILIES)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama + ChatML tokenizer on disk (built once per test session)."""
    from tiny import make_llama

    return make_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """model_type -> a tiny random image-text checkpoint of it at llama.cpp's geometry
    (tiny_vlm.save_gguf_vlm), saved once per test module: the GGUF + mmproj tests'."""
    from tiny_vlm import save_gguf_vlm

    cache = {}

    def get(model_type: str) -> Path:
        if model_type not in cache:
            cache[model_type] = save_gguf_vlm(tmp_path_factory.mktemp(model_type), model_type)
        return cache[model_type]

    return get


@pytest.fixture
def umask_027():
    """The process's umask set to 027 for one test (neither the usual 022 nor safetensors' own 600
    gives its 640); returns the mode a new file gets, 0o640."""
    old = os.umask(0o027)
    try:
        yield 0o640
    finally:
        os.umask(old)


# The per-test CPU budget of tests/unit (tests/budget.py): its hooks, registered as this conftest's.
from budget import pytest_addoption, pytest_runtest_makereport, pytest_runtest_setup  # noqa: E402, F401


def pytest_sessionstart(session):
    """Import what nearly every test process needs once, before the first test: torch, transformers'
    model classes, peft and bitsandbytes cost ~10 CPU s together, and whichever test came first was
    charged for them by tests/budget.py (xdist's first test of a worker differs run to run). The
    xdist controller runs no tests and skips them."""
    if getattr(session.config, "workerinput", None) is None and session.config.getoption("numprocesses", None):
        return
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers

    transformers.AutoModelForCausalLM, transformers.LlamaForCausalLM  # noqa: B018  (lazy modules: resolved now)
    _freeze_garbage_collector()


def pytest_collection_finish(session):
    """The collected tests and their modules, alive until the session ends, out of the collector's
    way too (`_freeze_garbage_collector`)."""
    _freeze_garbage_collector()


def _freeze_garbage_collector() -> None:
    """Move every object alive now (the libraries' ~500k module-level objects) into the collector's
    permanent generation (gc.freeze), where no later collection scans them. They stay alive for the
    whole session anyway; without this every full collection in a test process walked all of them:
    the export check's gc.collect (export/merged.py, freeing one model before loading the next) took
    ~0.3 s a run, and the automatic ones added up to a fifth of tests/e2e/test_families.py's LoRA
    runs' CPU (11.6 of 55 CPU s; 4.5 of 45.5 frozen)."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduler for `-n N` (`--dist load`, `loadfile`, `loadscope` or `loadgroup`): a
    module that builds a module- or class-scoped fixture runs on one worker (the fixture is built
    once), every test of tests/distributed on one worker, one after another (each starts
    multi-process runs, torchrun, namespaces, doctor, that take both cores with their 2 ranks, and
    some measure links and timeouts), and every other test wherever a worker is free: whole modules
    of independent tests left one worker idle at the end while the other ran a large module alone.

    This hook is xdist's public way to choose. `--dist loadgroup` with `xdist_group` marks, which this
    conftest used, stopped grouping anything under pytest 9.2 (pytest-xdist 3.8 writes the group into
    `item._nodeid`, which pytest 9.2 no longer reads a node's id from), silently. The scheduler runs in
    the controlling process, which sees node ids only, so a module's fixtures are read from its source
    (`_shares_fixtures`)."""
    if config.getvalue("dist") not in ("load", "loadfile", "loadscope", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Grouped(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path.startswith("tests/distributed/"):
                return "tests/distributed"
            return path if _shares_fixtures(path) else nodeid

    return Grouped(config, log)


_SHARED_SCOPES = re.compile(r"""^@pytest\.fixture\(.*scope=["'](?:module|class)["'].*\n(?:@.*\n)*def (\w+)""", re.M)


_OURS_SHARED = tuple(_SHARED_SCOPES.findall(Path(__file__).read_text()))
"""This conftest's module-scoped fixtures (`vlm`)."""


@functools.cache
def _shares_fixtures(path: str) -> bool:
    """Whether the test module at `path` (relative to the repository) defines a module- or
    class-scoped fixture, or uses one of this conftest's."""
    try:
        text = (Path(__file__).parents[1] / path).read_text()
    except OSError:
        return False
    return bool(_SHARED_SCOPES.search(text)) or any(re.search(rf"\b{name}\b", text) for name in _OURS_SHARED)


def _matrix_point(item) -> bool:
    """A unit test's parameter that is a family of tests/families.py or a released config of
    tests/configs outside the core ones (families.CORE, CORE_CONFIGS): the depth of a family matrix
    that `make test` runs and `make test-unit` leaves to it (`-m "not matrix"`). Every block kind
    the code branches on stays in the fast loop; the other families repeat those code paths with
    other sizes and names, which is what the full suite is for."""
    import families

    callspec = getattr(item, "callspec", None)
    if callspec is None or "unit" not in item.path.relative_to(Path(__file__).parent).parts[:1]:
        return False
    configs = {p.stem for p in (Path(__file__).parent / "configs").glob("*.json")}
    for value in callspec.params.values():
        if isinstance(value, str) and ((value in families.FAMILIES and value not in families.CORE)
                                       or (value in configs and value not in families.CORE_CONFIGS)):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    """Unit tests at a family matrix's outer points are marked `matrix` (`_matrix_point`)."""
    for item in items:
        if _matrix_point(item):
            item.add_marker(pytest.mark.matrix)
