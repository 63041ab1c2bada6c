"""WAL checkpoints of a SQLite store run in the store's checkpoint thread, not in the commits: the store's
connections never checkpoint by themselves, the thread copies the WAL into the database file after
writes, and closing the store leaves the database file complete on its own."""

from __future__ import annotations

import shutil
import sqlite3
import time
from pathlib import Path

from tests.gateway.helpers import make_record
from tracegym.gateway.traces.call_spans import call_batch
from tracegym.gateway.traces.store import Store


def _spans_in_file_alone(db: Path, tmp: Path) -> int:
    """The spans the database file holds without its WAL (a copy of the file by itself)."""
    alone = tmp / "alone.db"
    shutil.copy(db, alone)
    with sqlite3.connect(alone) as conn:
        try:
            return conn.execute("SELECT count(*) FROM spans").fetchone()[0]
        except sqlite3.OperationalError:  # not even the schema is in the file yet
            return 0


def test_the_checkpoint_thread_copies_the_wal_and_commits_do_not(tmp_path: Path) -> None:
    db = tmp_path / "tg.db"
    store = Store.open(f"sqlite:///{db}")
    try:
        with store.db.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == 0
        checkpointer = store.db.checkpointer
        assert checkpointer is not None
        before = checkpointer.checkpoints
        store.insert_spans(call_batch([make_record(i, rollout_id=f"ro-{i}") for i in range(50)]))
        deadline = time.monotonic() + 30
        while _spans_in_file_alone(db, tmp_path) < 50:  # the thread copies the WAL into the file
            assert time.monotonic() < deadline, "the WAL was never checkpointed"
            time.sleep(0.05)
        while checkpointer.checkpoints <= before:  # counted once the pragma returns, just after the copy
            assert time.monotonic() < deadline, "the file was written, but not by the checkpoint thread"
            time.sleep(0.01)
        store.insert_spans(call_batch([make_record(i, rollout_id=f"ro-late-{i}") for i in range(5)]))
    finally:
        store.close()
    assert _spans_in_file_alone(db, tmp_path) == 55  # closing checkpointed the last writes
