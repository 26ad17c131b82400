"""This machine's RAM as the kernel reports it (/proc/meminfo), torch-free.

At the root because three stages read it: the planner's hardware probe (plan/hardware.py: how
much host RAM a node has), the train command's activation-offload check, and export (merge in
memory only when the base fits four times over in what is free).
"""

from __future__ import annotations

import os


def total_ram_bytes() -> int:
    """Installed RAM (MemTotal, else the page count from sysconf)."""
    total = _meminfo("MemTotal")
    return total if total is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_ram_bytes() -> int:
    """Host RAM the kernel could give a new allocation now (MemAvailable; 0 when unknown)."""
    return _meminfo("MemAvailable") or 0


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None
