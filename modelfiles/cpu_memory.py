"""Keeping the memory a model process frees for its next step (glibc's ``malloc`` on Linux).

A trainer frees about the same gigabyte of tensors at the end of every step (activations, gradients, the
logits) and allocates it again at the next; an engine does the same with each round's batch. glibc gives
every block above its mmap threshold (128 KiB, rising to at most 32 MiB) straight back to the kernel and
trims the top of its heap, so every step faults those pages in again and the kernel zeroes each one: that
is the system time of a steady training step on a CPU (docs/benchmarks.md). On a virtual machine with free
page reporting (virtio-balloon) memory left free for a couple of seconds can also go back to the host, and
touching it again is a fault into the host; a trainer waiting while the engine generates, and an engine
waiting while the trainer trains, leave that much time between two steps.

``keep_freed_memory`` asks glibc to serve large blocks from its heap and never to trim it, so freed memory
stays in the process for its next step. The price: the process's resident memory stays at its peak.
``TRACEGYM_KEEP_FREED_MEMORY=0`` leaves glibc's defaults."""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

KEEP_FREED_MEMORY_ENV = "TRACEGYM_KEEP_FREED_MEMORY"

# mallopt(3) parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Make this process's ``malloc`` keep what it frees (module docstring). True when it took effect:
    False on a system without glibc's ``mallopt``, or when ``TRACEGYM_KEEP_FREED_MEMORY=0``."""
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # a libc without mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # no block of its own mapping for a large allocation (it would be unmapped when freed), and the heap's
    # top never given back (-1: no threshold); mallopt answers 1 for a setting it took
    kept = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, -1) == 1
    if kept:
        log.debug("malloc keeps the memory this process frees ($%s=0 leaves glibc's defaults)",
                  KEEP_FREED_MEMORY_ENV)
    return kept
