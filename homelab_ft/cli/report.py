"""`homelab-ft report RUN`: the run's curves, memory against the plan and eval scores as one HTML page."""

from __future__ import annotations

from pathlib import Path


def add_report(sub) -> None:
    p = sub.add_parser("report", help="write RUN/report/report.html: loss, lr, tokens/s, memory vs plan, eval scores")
    p.add_argument("run", type=Path, help="a run directory")
    p.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    from homelab_ft.report.page import write_report

    print(f"wrote {write_report(args.run)}")
    return 0
