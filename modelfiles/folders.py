"""Writing a folder so that a complete copy is always on disk: built beside its destination, then renamed
into place, the previous copy kept aside until the new one is there."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created if missing), between processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)



def aside_dir(dest: Path) -> Path:
    """Where ``replace_dir`` keeps the previous ``dest`` while the new one is renamed into place."""
    return dest.parent / f".{dest.name}.old"


def replace_dir(tmp: Path, dest: Path) -> Path:
    """Make the finished directory ``tmp`` become ``dest`` so that a complete copy is always on disk: an
    existing ``dest`` is renamed aside (``aside_dir``), ``tmp`` is renamed to ``dest``, then the old copy
    is deleted. A crash in between leaves the previous copy in ``aside_dir(dest)``, which
    ``recover_dir`` moves back. (Deleting ``dest`` first would lose the only copy on such a crash.)"""
    tmp, dest = Path(tmp), Path(dest)
    aside = aside_dir(dest)
    if dest.exists():
        shutil.rmtree(aside, ignore_errors=True)  # a leftover next to a complete dest is stale
        os.rename(dest, aside)
    # with dest absent, a leftover aside copy is the only old one: it stays until the new one is in place
    os.rename(tmp, dest)
    shutil.rmtree(aside, ignore_errors=True)
    return dest


def recover_dir(dest: Path) -> Path:
    """``dest``, moved back from ``aside_dir(dest)`` first if a ``replace_dir`` was interrupted between
    its two renames (``dest`` missing, the previous copy aside)."""
    dest = Path(dest)
    aside = aside_dir(dest)
    if not dest.exists() and aside.is_dir():
        os.rename(aside, dest)
    return dest


@contextlib.contextmanager
def writing_folder(dest: Path) -> Iterator[Path]:
    """A fresh temporary sibling of ``dest`` to write into; when the block ends without an error it
    becomes ``dest`` (``replace_dir``), otherwise it is removed and ``dest`` stays as it was."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        replace_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
