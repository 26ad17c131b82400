"""Shared by the multi-process tests: a clean environment for torchrun children, a checked
subprocess run, a small chat dataset, and the recipe of one job of tests/distributed/worker.py."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import build_recipe

REPO = Path(__file__).resolve().parents[1]
_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def child_env(*, tmpdir: Path | None = None) -> dict:
    """One thread per rank (2 ranks on 2 cores: more threads made steps up to 8x slower), the
    repo importable, and no torchrun variables inherited from an outer launch; with `tmpdir`, the
    processes' temporary files there (made now), for a test to check that none is left."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    if tmpdir is not None:
        tmpdir.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(tmpdir)
    for var in _TORCHRUN_VARS:
        env.pop(var, None)
    return env


def homelab_ft_here(args: list[str]) -> subprocess.CompletedProcess:
    """`homelab-ft ARGS` run by this process, as `subprocess.run([python, "-m", "homelab_ft", *ARGS],
    env=child_env(), capture_output=True)` would run it: child_env()'s environment while it runs, and
    its stdout and stderr captured at the file descriptors, so the torchrun agent and ranks it starts
    write there too. For tests whose subject is the run, not the command's own interpreter: here its
    ~6 CPU s of imports (torch, transformers, datasets) are paid already. The console entry point's
    own process is tested where it is the subject (tests/unit/cli/test_cli_errors.py,
    test_train_command, test_signals)."""
    import sys

    from homelab_ft.cli.main import main

    saved_env, saved_streams = dict(os.environ), (sys.stdout, sys.stderr)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        for stream in saved_streams:
            stream.flush()
        saved_fds = os.dup(1), os.dup(2)
        os.environ.clear()
        os.environ.update(child_env())
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout, sys.stderr = out, err
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse's usage errors leave through sys.exit, as from the console
            code = exit_.code if isinstance(exit_.code, int) else 1
        finally:
            out.flush()
            err.flush()
            sys.stdout, sys.stderr = saved_streams
            for fd, saved in zip((1, 2), saved_fds, strict=True):
                os.dup2(saved, fd)
                os.close(saved)
            os.environ.clear()
            os.environ.update(saved_env)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(["homelab-ft", *args], code, out.read(), err.read())


WORKER = REPO / "tests" / "distributed" / "worker.py"


@dataclass(frozen=True)
class Workers:
    """tests/distributed/worker.py's jobs (`spec`, results to `out`) in `nprocs` processes: one plain
    process, or a gloo process group of `nprocs` ranks with torchrun's variables (RANK, WORLD_SIZE,
    MASTER_ADDR ...), as `torchrun --standalone --nproc-per-node=N worker.py` starts them.

    The processes are forked from one forkserver per pytest process that has imported what a worker
    imports (tests/worker_preload.py): a fresh interpreter paid ~8 CPU s of imports per rank and
    torchrun's agent ~2 more, most of what a launch of a few tiny-model jobs cost. torchrun itself,
    its agent and `homelab-ft train`'s launch are tested where they are the subject (test_train_command,
    test_signals, the netns and doctor tests), which start real commands."""

    spec: Path
    out: Path
    nprocs: int = 1
    procs_per_node: int = 0
    """Ranks per node (LOCAL_WORLD_SIZE) of the group; 0: every rank on one node. torchrun on each
    of `nprocs // procs_per_node` nodes gives the ranks the same variables (GROUP_RANK: the node)."""

    def __str__(self) -> str:
        return f"worker.py {self.spec.name} on {self.nprocs} process{'es' if self.nprocs > 1 else ''}"


_FORKSERVER = None


def _forkserver():
    """multiprocessing's forkserver context, its server started now and preloaded with
    tests/worker_preload.py. Python 3.11's forkserver imports its preload modules before it takes
    the parent's sys.path, so tests/ reaches it through PYTHONPATH, set for its start only."""
    global _FORKSERVER
    if _FORKSERVER is None:
        import multiprocessing
        from multiprocessing import forkserver

        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["worker_preload"])
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), str(REPO), *filter(None, [saved])])
        try:
            forkserver.ensure_running()
        finally:
            os.environ.pop("PYTHONPATH") if saved is None else os.environ.__setitem__("PYTHONPATH", saved)
        _FORKSERVER = context
    return _FORKSERVER


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_worker_rank(spec: str, out: str, rank: int, nprocs: int, per_node: int, port: int, log: str) -> None:
    """One forked process: its output to `log`, torchrun's variables for a group, worker.main."""
    import importlib.util

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for var in _TORCHRUN_VARS:
        os.environ.pop(var, None)
    os.environ.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if nprocs > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % per_node), GROUP_RANK=str(rank // per_node),
                          ROLE_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=f"forked-{port}")
    import torch

    torch.set_num_threads(1)
    module_spec = importlib.util.spec_from_file_location("worker", WORKER)
    worker = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(worker)
    from homelab_ft.distributed import comm

    comm.exit_now(worker.main(spec, out))


class _Started:
    """A job of `run_beside` once started: a command's process or a Workers' processes."""

    def __init__(self, job, stack: contextlib.ExitStack):
        self.job = job
        if isinstance(job, Workers):
            ctx, port = _forkserver(), _free_port()
            self.logs = [stack.enter_context(tempfile.NamedTemporaryFile("r", suffix=f".rank{r}.log"))
                         for r in range(job.nprocs)]
            per_node = job.procs_per_node or job.nprocs
            self.procs = [ctx.Process(target=_run_worker_rank, args=(str(job.spec), str(job.out), r, job.nprocs, per_node,
                                                                      port, log.name)) for r, log in enumerate(self.logs)]
            for proc in self.procs:
                proc.start()
        else:
            # Output to files, not pipes: a pipe nobody reads yet would stall its writer once full.
            self.logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2)]
            self.procs = [subprocess.Popen(job, env=child_env(), stdout=self.logs[0], stderr=self.logs[1], text=True,
                                           cwd=REPO)]

    def _codes(self) -> list[int | None]:
        return [p.poll() if isinstance(p, subprocess.Popen) else p.exitcode for p in self.procs]

    def running(self) -> bool:
        """Whether a process is still running; a rank that failed stops its peers, as torchrun's
        agent does (they would wait in a collective until the process group's timeout)."""
        codes = self._codes()
        if any(code not in (None, 0) for code in codes):
            self.kill()
            return False
        return any(code is None for code in codes)

    def kill(self) -> None:
        for proc in self.procs:
            if isinstance(proc, subprocess.Popen):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            elif proc.exitcode is None:
                proc.kill()
                proc.join()

    def check(self) -> None:
        if isinstance(self.job, Workers):
            for rank, (proc, log) in enumerate(zip(self.procs, self.logs, strict=True)):
                log.seek(0)
                _check([f"{self.job}, rank {rank}"], proc.exitcode, "", log.read())
        else:
            out, err = self.logs
            out.seek(0)
            err.seek(0)
            _check(self.job, self.procs[0].returncode, out.read(), err.read())


def run_checked(job: list[str] | Workers, *, timeout: int = 600) -> None:
    """Run a command (argv) or tests/distributed/worker.py's jobs (`Workers`) and check it ends with 0,
    raising with its output otherwise."""
    run_beside(job, timeout=timeout)


def run_beside(*jobs: list[str] | Workers, timeout: int = 600) -> None:
    """Run independent commands or worker jobs at once and check each, as `run_checked` does.

    For a 2-rank run beside the one-process reference it is compared with: run one after the
    other, the one-thread reference left one of the 2 cores idle for its whole length; together the
    same work fills both. Parity is unaffected (each process computes what it would alone); only
    for jobs that read nothing the other writes (each has its own run folders)."""
    with contextlib.ExitStack() as stack:
        started = [_Started(job, stack) for job in jobs]
        try:
            deadline = time.monotonic() + timeout
            while any([job.running() for job in started]):  # every job polled, each failure acted on
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(" & ".join(str(job.job) for job in started), timeout)
                time.sleep(0.05)
        finally:
            for job in started:
                job.kill()
        for job in started:
            job.check()


def _check(argv: list[str], returncode: int, stdout: str, stderr: str) -> None:
    if returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed ({returncode}):\n{stdout[-3000:]}\n{stderr[-6000:]}")


def job_recipe(tmp: Path, model_dir: Path, name: str, *, procs: int, method: str = "lora", rows: str = "train.jsonl",
               sharding: dict | None = None, **sections) -> dict:
    """build_recipe.tiny_run for a job named `name`: its rows at tmp/ROWS, its run folder tmp/runs/NAME,
    `procs` processes on one node, sharded by `sharding` when there are 2 or more (none for one process);
    `sections` are merged over these as tiny_run merges them over its defaults."""
    job = {"name": name, "output": {"dir": str(tmp / "runs" / name)}, "cluster": {"nodes": 1, "gpus_per_node": procs},
           "sharding": (sharding or {}) if procs > 1 else {}}
    return build_recipe.merged(build_recipe.tiny_run(model_dir, method=method, rows=tmp / rows, **job), sections)


def write_chat_data(
    path: Path, num_rows: int, *, seed: int = 0, answer_prefix: str = "", max_q_words: int = 12, max_a_words: int = 10
) -> Path:
    """Random short user/assistant turns over a word list the tiny tokenizer knows."""
    rng = random.Random(seed)
    words = "the quick brown fox jumps over lazy dog answer yes no paris capital".split()
    with path.open("w") as fh:
        for _ in range(num_rows):
            q = " ".join(rng.choice(words) for _ in range(rng.randint(2, max_q_words)))
            a = answer_prefix + " ".join(rng.choice(words) for _ in range(rng.randint(1, max_a_words)))
            fh.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n")
    return path


def write_pair_data(path: Path, num_rows: int, *, seed: int = 0, max_q_words: int = 8) -> Path:
    """Preference pairs over the tiny tokenizer's words: the chosen answer says yes, the rejected no."""
    rng = random.Random(seed)
    words = "the quick brown fox jumps over lazy dog capital paris".split()
    with path.open("w") as fh:
        for _ in range(num_rows):
            q = " ".join(rng.choice(words) for _ in range(rng.randint(2, max_q_words)))
            tail = " ".join(rng.choice(words) for _ in range(rng.randint(0, 3)))
            fh.write(json.dumps({"prompt": q, "chosen": f"answer: yes {tail}".strip(),
                                 "rejected": f"answer: no {' '.join(rng.choice(words) for _ in range(rng.randint(0, 3)))}".strip()}) + "\n")
    return path


def write_unpaired_data(path: Path, num_pairs: int, *, seed: int = 0) -> Path:
    """KTO's unpaired rows: write_pair_data's pairs taken apart, each chosen answer a row labelled true,
    each rejected one a row labelled false (the demo's rule, homelab_ft/demo/dpo.py)."""
    pairs = write_pair_data(path, num_pairs, seed=seed).read_text().splitlines()
    rows = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
            for p in map(json.loads, pairs) for side in ("chosen", "rejected")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


_PLANS = """
import contextlib, io, json, sys
from homelab_ft.cli.main import main
done = []
for args in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)
    done.append([rc, out.getvalue(), err.getvalue()])
    assert 'torch' not in sys.modules, f'plan {args} imported torch'
print(json.dumps(done))
"""


def plan_here(*args: str) -> None:
    """`homelab-ft plan ARGS` in this process, its output dropped: it derives and caches the model's
    shape (plan/shape/cache.py), so a fresh process planning it next reads the cache, torch-free."""
    import contextlib
    import io

    from homelab_ft.cli.main import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main(["plan", *args])


def plans_without_torch(commands: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """`homelab-ft plan ARGS` for each ARGS of `commands`, one after another in one fresh process
    that must not import torch (none of them may). The first plan of a config derives its shape
    with torch (plan/shape/derive.py) and caches it (plan/shape/cache.py), so each runs once first here,
    in the test's process, which has torch already; planning again is what a user repeats, and
    what is checked. One interpreter for all: each fresh one cost ~2 CPU s of imports."""
    import sys

    for args in commands:
        plan_here(*args)
    proc = subprocess.run([sys.executable, "-c", _PLANS, json.dumps([["plan", *a] for a in commands])],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    if proc.returncode != 0:
        raise AssertionError(f"plan without torch failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return [subprocess.CompletedProcess(["plan", *a], rc, out, err)
            for a, (rc, out, err) in zip(commands, json.loads(proc.stdout.splitlines()[-1]), strict=True)]


def mounted(path: Path, *mount_args: str):
    """`mount MOUNT_ARGS PATH` for a pytest fixture (a generator): a real full disk (tmpfs) or a
    read-only target (bind mount) for the tests of what ENOSPC and EROFS leave. Needs root (skips
    otherwise); always unmounted."""
    import pytest

    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", *mount_args, str(path)], capture_output=True).returncode:
        pytest.skip("mounting needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def small_tmpfs(path: Path, size: str):
    """A tmpfs of `size` (mount's `size=`, e.g. 700k, 60m) at `path`: see `mounted`."""
    yield from mounted(path, "-t", "tmpfs", "-o", f"size={size}", "tmpfs")


def step_rows(run: Path) -> dict[int, dict]:
    """A run's training rows of metrics.jsonl by step (eval and samples rows left out)."""
    from homelab_ft.train.metrics import read_metrics

    return {r["step"]: r for r in read_metrics(Path(run) / "metrics.jsonl") if "loss" in r}
