"""Make a Python environment that runs llama.cpp's multimodal library, for tools/llama_mtmd.py and
the test that compares a GGUF + mmproj in llama.cpp with transformers.

    python3 tools/llama_mtmd_env.py VENV            # then: HOMELAB_FT_LLAMA_MTMD_PYTHON=VENV/bin/python

Never the project's venv: the package brings its own numpy and cffi. It installs PyPI's
`llama-cpp-py-sync` 0.11739, CFFI bindings whose manylinux wheel bundles libllama and libmtmd of
llama.cpp b11739 (commit 0ce8cd11) built for the CPU; nothing is compiled from llama.cpp's source.

That wheel's libraries were linked against glibc 2.38 for four C23 entry points only
(`__isoc23_strtol`, `strtoul`, `strtoull`, `sscanf`, which differ from the older ones in accepting
`0b` binary literals). On an older glibc (Debian 12 has 2.36) they do not load. There this script
builds a small shim library forwarding those four to the pre-C23 functions (cc), clears their
version tags and adds the shim as a dependency (patchelf), and marks the remaining GLIBC_2.38
version requirement weak (an ELF flag, VER_FLG_WEAK), so the dynamic loader accepts the libraries.
Measured here: the patched libraries load a GGUF + mmproj and encode an image (tools/llama_mtmd.py).
"""

from __future__ import annotations

import os
import platform
import struct
import subprocess
import sys
from pathlib import Path

PACKAGE = "llama-cpp-py-sync==0.11739"
C23 = ("__isoc23_strtol", "__isoc23_strtoul", "__isoc23_strtoull", "__isoc23_sscanf")
SHIM = """
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
long __isoc23_strtol(const char *s, char **end, int base) { return strtol(s, end, base); }
unsigned long __isoc23_strtoul(const char *s, char **end, int base) { return strtoul(s, end, base); }
unsigned long long __isoc23_strtoull(const char *s, char **end, int base) { return strtoull(s, end, base); }
int __isoc23_sscanf(const char *s, const char *fmt, ...) {
    va_list ap; va_start(ap, fmt); int n = vsscanf(s, fmt, ap); va_end(ap); return n;
}
"""


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    venv = Path(argv[1]).resolve()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", PACKAGE], check=True)
    package = Path(subprocess.run([str(python), "-c", "import llama_cpp_py_sync, os; print(os.path.dirname("
                                   "llama_cpp_py_sync.__file__))"], check=True, capture_output=True,
                                  text=True).stdout.strip())
    glibc = tuple(int(part) for part in platform.libc_ver()[1].split(".")[:2])
    if glibc < (2, 38):
        patch_for_old_glibc(package)
    check = subprocess.run([str(python), "-c", "from llama_cpp_py_sync._cffi_bindings import get_mtmd_lib; "
                            "get_mtmd_lib(); import llama_cpp_py_sync as l; print(l.__llama_cpp_tag__)"],
                           capture_output=True, text=True)
    if check.returncode:
        print(check.stderr.strip().splitlines()[-1], file=sys.stderr)
        return 1
    print(f"llama.cpp {check.stdout.strip()} with libmtmd: HOMELAB_FT_LLAMA_MTMD_PYTHON={python}")
    return 0


def patch_for_old_glibc(package: Path) -> None:
    """The module docstring's shim, version tags and weak requirement, in place."""
    shim = package / "libisoc23shim.so"
    source = package / "isoc23shim.c"
    source.write_text(SHIM)
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(shim), str(source)], check=True)
    for library in sorted(package.glob("lib*.so*")):
        if library == shim or os.path.islink(library):
            continue
        for symbol in C23:
            subprocess.run(["patchelf", "--clear-symbol-version", symbol, str(library)], check=True)
        subprocess.run(["patchelf", "--add-needed", shim.name, "--set-rpath", "$ORIGIN", str(library)], check=True)
        weaken_version(library, b"GLIBC_2.38")


def weaken_version(path: Path, version: bytes) -> int:
    """Set VER_FLG_WEAK on every requirement of `version` in an ELF64 file's .gnu.version_r; returns
    how many were set."""
    data = bytearray(path.read_bytes())
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    done = 0
    for _, kind, _, _, offset, _, link, count, _, _ in sections:
        if kind != 0x6FFFFFFE:  # SHT_GNU_verneed
            continue
        strings, entry = sections[link][4], offset
        for _ in range(count):
            _, aux_count, _, aux_at, next_entry = struct.unpack_from("<HHIII", data, entry)
            aux = entry + aux_at
            for _ in range(aux_count):
                _, flags, _, name, next_aux = struct.unpack_from("<IHHII", data, aux)
                if bytes(data[strings + name:data.index(b"\0", strings + name)]) == version:
                    struct.pack_into("<H", data, aux + 4, flags | 0x2)
                    done += 1
                aux += next_aux
            entry += next_entry
    path.write_bytes(data)
    return done


if __name__ == "__main__":
    sys.exit(main(sys.argv))
