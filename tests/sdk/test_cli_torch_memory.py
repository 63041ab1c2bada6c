"""Every ``tracegym`` command, and the processes it starts, asks torch's CPU allocator for transparent huge
pages (``cli.TORCH_ENVIRONMENT``): a large tensor touched for the first time then faults in 2 MB at a time.
Checked by the faults themselves, in a process that ran ``tracegym.cli.main``; a value the user set is kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tracegym.cli import TORCH_ENVIRONMENT

ROOT = Path(__file__).resolve().parents[2]
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MB = 64

# the page faults of a child of a process that ran main(), touching a fresh MB-megabyte tensor
PROBE = f"""
import subprocess, sys
from tracegym import cli
cli._load = lambda command: (lambda args: 0)  # only what main sets up is needed, not the command
cli.main(["export", "--out", "x.jsonl"])
child = '''
import resource, torch
x = torch.empty({MB} << 18)  # float32: {MB} MB
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x.fill_(1.0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
'''
print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout.strip())
"""


def _faults(**env: str) -> int:
    clean = {k: v for k, v in os.environ.items() if k not in TORCH_ENVIRONMENT}
    res = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                         env=clean | env, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return int(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_a_commands_children_fault_in_large_tensors_by_huge_pages() -> None:
    small_pages = MB << 8  # 4 KB pages in MB megabytes
    # huge pages: one fault per 2 MB (and a few 4 KB ones at the unaligned ends); the kernel falls back to
    # small pages only where it finds no free 2 MB of memory
    assert _faults() < small_pages // 4
    # the user's choice is kept
    assert _faults(THP_MEM_ALLOC_ENABLE="0") >= small_pages * 9 // 10
