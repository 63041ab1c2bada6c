"""SQLite WAL checkpoints in a thread of their own, off the commit path.

SQLite's automatic checkpoint runs inside the commit that pushes the WAL past 1,000 pages: that commit
copies the WAL into the database file and, with ``synchronous=NORMAL``, waits for two ``fsync``s. A
gateway that answers a call only once its span is committed would make that call wait for them (on a
virtual disk, 15 ms and more at p99, against a 0.1 ms commit). So the store's connections run with
``wal_autocheckpoint=0`` and a ``Checkpointer`` thread, woken after writes, runs ``PRAGMA
wal_checkpoint(PASSIVE)`` on its own connection: it copies what no reader still needs while writers go
on committing to the WAL, and SQLite starts the WAL over at the next write once everything was copied.
Should the WAL still grow past ``restart_pages`` (readers holding old snapshots, writes faster than the
copy), a ``RESTART`` checkpoint waits for the writer between two transactions and starts the WAL over.
Durability is unchanged: a commit is in the WAL before it returns; the checkpoint only moves it.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading

log = logging.getLogger(__name__)

CHECKPOINT_EVERY_S = 0.25
"""How long the thread lets writes gather before a checkpoint (many commits, one checkpoint)."""
RESTART_PAGES = 4_096
"""WAL pages (64 MiB at 16 KiB pages) past which a checkpoint waits for the writer and restarts the WAL."""


class Checkpointer:
    """Checkpoints the WAL of the SQLite file ``path`` after ``written()`` calls, in a daemon thread."""

    def __init__(self, path: str, *, every_s: float = CHECKPOINT_EVERY_S, restart_pages: int = RESTART_PAGES,
                 busy_timeout_ms: int = 30_000) -> None:
        self.path = path
        self.every_s = every_s
        self.restart_pages = restart_pages
        self.busy_timeout_ms = busy_timeout_ms
        self.checkpoints = 0
        self._dirty = threading.Event()
        self._closing = threading.Event()  # set by close(): stops the thread, cutting its gathering pause short
        self._thread = threading.Thread(target=self._run, name="tracegym-wal-checkpoint", daemon=True)
        self._thread.start()

    def written(self) -> None:
        """A write transaction committed (called by the store after each one; cheap when already set)."""
        if not self._dirty.is_set():
            self._dirty.set()

    def checkpoint(self, conn: sqlite3.Connection, mode: str = "PASSIVE") -> tuple[int, int, int]:
        """One checkpoint on ``conn``: ``(busy, WAL pages, pages copied)`` as SQLite reports them."""
        busy, pages, copied = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        self.checkpoints += 1
        return busy, pages, copied

    def _run(self) -> None:
        self._dirty.wait()  # connected once the store has written (the file exists by then)
        if not os.path.exists(self.path):  # closed before any write, or the file was removed meanwhile
            return
        try:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error:
            log.exception("cannot open %s to checkpoint its WAL", self.path)
            return
        try:
            conn.execute(f"PRAGMA busy_timeout = {self.busy_timeout_ms}")
            while not self._closing.is_set():
                self._dirty.wait()
                if self._closing.is_set():
                    break
                self._closing.wait(self.every_s)  # let commits gather: one checkpoint copies the pages of many
                self._dirty.clear()
                self._once(conn)
            self._once(conn)  # what the last writes left
        finally:
            conn.close()

    def _once(self, conn: sqlite3.Connection) -> None:
        try:
            _, pages, _ = self.checkpoint(conn)
            if pages > self.restart_pages:
                self.checkpoint(conn, "RESTART")
        except sqlite3.Error:  # e.g. the file went away under us: the next write's checkpoint tries again
            log.exception("WAL checkpoint of %s failed", self.path)

    def close(self, timeout_s: float = 30.0) -> None:
        """Checkpoint what is left and stop the thread (idempotent)."""
        self._closing.set()
        self._dirty.set()
        self._thread.join(timeout_s)
