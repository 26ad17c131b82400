"""torchrun for one machine, as a child that `homelab-ft train` answers for.

`python -m homelab_ft.supervise TORCHRUN_ARGS...` runs torchrun's own agent in this process and
turns its endings into one line each, instead of ~70 lines of agent log and ChildFailedError
traceback:
- a rank killed by a signal (the kernel's OOM killer sends SIGKILL, and nothing else prints a
  word): which rank, which signal and the likely cause, with the planner's memory figure;
- a rank that exited with an error: the rank has printed its own message already (a UserError's
  one line, or our bug's traceback), so nothing more is added and its exit code is passed on;
- torchrun itself stopped by SIGTERM/SIGINT (forwarded by `launch.run_supervised`): the agent has
  forwarded it to every rank and waited for them to save (train.save_on_interrupt); exit 128+sig.

The memory figure comes from the parent in $HOMELAB_FT_MEMORY_NOTE (launch.memory_note).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

MEMORY_NOTE_VAR = "HOMELAB_FT_MEMORY_NOTE"


def cause(signum: int, memory_note: str) -> str:
    if signum == signal.SIGKILL:
        return ("most likely the kernel's OOM killer (host RAM ran out; `dmesg | grep -i oom` shows it)"
                + (f"; {memory_note}" if memory_note else "") + ", or a `kill -9`")
    if signum in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL):
        return "a crash in native code (a CUDA driver or library, or a GPU out of memory inside one); see the lines above"
    return "stopped from outside (another user, a scheduler or the system)"


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # The agent logs each worker's exit and each signal it forwards at WARNING/ERROR; the lines
    # below say the same once. Rendezvous and other agent failures still raise with a traceback.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    memory_note = os.environ.pop(MEMORY_NOTE_VAR, "")
    try:
        run(parse_args(argv))
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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
