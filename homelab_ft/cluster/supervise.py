"""torchrun for one machine, as a child that `homelab-ft train` answers for.

`python -m homelab_ft.cluster.supervise TORCHRUN_ARGS...` runs torchrun's own agent in this process and
turns its endings into one line each, instead of ~70 lines of agent log and ChildFailedError
traceback:
- a rank killed by a signal (the kernel's OOM killer sends SIGKILL, and nothing else prints a
  word): which rank, which signal and the likely cause, with the planner's memory figure;
- a rank that exited with an error: the rank has printed its own message already (a UserError's
  one line, or our bug's traceback), so nothing more is added and its exit code is passed on;
- torchrun itself stopped by SIGTERM/SIGINT (forwarded by `launch.run_supervised`): the agent has
  forwarded it to every rank and waited for them to save (train.save_on_interrupt); exit 128+sig.

- a node of a multi-node job that never joined (the rendezvous' join timeout), or a head node
  that cannot be reached: which address and port, which nodes of the hostfile may be missing
  ($HOMELAB_FT_NODES, set by launch.node_commands) and what to check, instead of torchrun's
  empty `RendezvousTimeoutError` and pages of C++ stack from the store's retries.

The memory figure comes from the parent in $HOMELAB_FT_MEMORY_NOTE (launch.memory_note).

torchrun keeps each rank's error file (and, when asked, its output) in a log folder, by default a
`torchelastic_*` folder in /tmp that it never removes: one left behind per launch. Unless the
command names one (`--log-dir`), the agent here gets a temporary folder, removed however the agent
ends (a `kill -9` of this process aside).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile

MEMORY_NOTE_VAR = "HOMELAB_FT_MEMORY_NOTE"
NODES_VAR = "HOMELAB_FT_NODES"
"""The hostfile's rendezvous addresses, comma-separated, for naming a node that never joined."""


def cause(signum: int, memory_note: str) -> str:
    if signum == signal.SIGKILL:
        return ("most likely the kernel's OOM killer (host RAM ran out; `dmesg | grep -i oom` shows it)"
                + (f"; {memory_note}" if memory_note else "") + ", or a `kill -9`")
    if signum in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL):
        return "a crash in native code (a CUDA driver or library, or a GPU out of memory inside one); see the lines above"
    return "stopped from outside (another user, a scheduler or the system)"


def rendezvous_failure(*, timed_out: bool, endpoint: str, nnodes: str, join_timeout_s: str, local_addr: str | None,
                       nodes: list[str]) -> str:
    """One line for a rendezvous that did not gather every node (pure; unit-tested)."""
    head, _, port = endpoint.rpartition(":")
    others = [n for n in nodes if n != local_addr]
    if timed_out:
        missing = f"waiting for {', '.join(others)}" if len(others) == 1 else (
            f"one of {', '.join(others)} is missing" if others else f"{nnodes} nodes expected")
        return (f"not every node joined the rendezvous at {endpoint} within {join_timeout_s} s ({missing}); check that "
                f"the same command runs on {'that node' if len(others) == 1 else 'every node'}, that it can reach "
                f"{head} and that TCP port {port} is open on {head} (docs/troubleshooting.md)")
    return (f"could not reach the rendezvous at {endpoint} (the head node, first in the hostfile) within "
            f"{join_timeout_s} s; check that its command is running there, that {head} is its address on this LAN "
            f"and that TCP port {port} is open on it (docs/troubleshooting.md)")


def _rendezvous_line(args, err) -> str:
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    conf = dict(kv.split("=", 1) for kv in (args.rdzv_conf or "").split(",") if "=" in kv)
    nodes = [n for n in os.environ.get(NODES_VAR, "").split(",") if n]
    return rendezvous_failure(timed_out=isinstance(err, RendezvousTimeoutError), endpoint=args.rdzv_endpoint,
                              nnodes=str(args.nnodes), join_timeout_s=conf.get("join_timeout", "600"),
                              local_addr=args.local_addr, nodes=nodes)


def main(argv: list[str]) -> int:
    # The store's connection retries log C++ stack traces (TORCH_CPP_LOG_LEVEL is read once, when
    # torch loads); the line below says what failed. The workers get the user's own setting back.
    user_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
    from torch.distributed.run import parse_args, run

    if user_level is None:
        del os.environ["TORCH_CPP_LOG_LEVEL"]
    else:
        os.environ["TORCH_CPP_LOG_LEVEL"] = user_level

    # The agent logs each worker's exit and each signal it forwards at WARNING/ERROR; the lines
    # below say the same once. Rendezvous and other agent failures still raise with a traceback.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    memory_note = os.environ.pop(MEMORY_NOTE_VAR, "")
    args = parse_args(argv)
    own_logs = None
    if args.log_dir is None:
        own_logs = args.log_dir = tempfile.mkdtemp(prefix="homelab-ft-torchrun-")
    try:
        run(args)
    except (RendezvousTimeoutError, RendezvousConnectionError) as err:
        print(f"homelab-ft: error: {_rendezvous_line(args, err)}", file=sys.stderr)
        return 2
    except SignalException as err:
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode < 0:
            signum = -failure.exitcode
            print(f"homelab-ft: error: rank {rank} (pid {failure.pid}) was killed by {signal.Signals(signum).name}: "
                  f"{cause(signum, memory_note)}; the other ranks were stopped", file=sys.stderr)
            return 128 + signum
        return failure.exitcode
    finally:
        if own_logs is not None:
            shutil.rmtree(own_logs, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
