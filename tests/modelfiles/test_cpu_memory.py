"""keep_freed_memory: a large block freed and allocated again is served from the process's own pages
(no page faults), where glibc's defaults give it back to the kernel and fault it in again."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from tracegym.modelfiles.cpu_memory import KEEP_FREED_MEMORY_ENV, keep_freed_memory

# allocate, touch and free a 64 MiB block three times; print whether keep_freed_memory took effect and the
# minor page faults of the last two rounds (the first faults its pages in either way)
PROBE = """
import ctypes, json, resource, sys
from tracegym.modelfiles.cpu_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n, faults = 64 << 20, []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    libc.free(p)
print(json.dumps({"kept": kept, "faults": faults[1:]}))
"""

linux_glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                                 reason="glibc's mallopt only")


def probe(mode: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}, timeout=60)
    return json.loads(out.stdout)


@linux_glibc
def test_freed_memory_is_kept_for_the_next_allocation() -> None:
    kept = probe("keep")
    default = probe("default")
    assert kept["kept"] is True
    # 64 MiB is 16,384 pages of 4 KiB: glibc's default maps and unmaps the block each time
    assert all(f >= 1000 for f in default["faults"]), default
    assert all(f < 100 for f in kept["faults"]), kept


@linux_glibc
def test_the_environment_variable_leaves_glibc_defaults() -> None:
    off = probe("keep", **{KEEP_FREED_MEMORY_ENV: "0"})
    assert off["kept"] is False
    assert all(f >= 1000 for f in off["faults"]), off


def test_off_by_environment_without_touching_malloc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEEP_FREED_MEMORY_ENV, "off")
    assert keep_freed_memory() is False
