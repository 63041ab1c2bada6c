"""The PostgreSQL commit floor benchmark (benchmarks/pg_commit_floor.py) runs its measurements on a database of
its own and drops it."""

from __future__ import annotations

import re
import sys

import psycopg
import pytest

from benchmarks import pg_commit_floor
from tests.procs import PG_ADMIN_URL

pytestmark = pytest.mark.pg


def _floor_databases() -> set[str]:
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        rows = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'tg_floor_%'").fetchall()
    return {name for (name,) in rows}


def test_a_short_run_prints_each_write_and_drops_its_database(
    pg_database: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    server = pg_database.replace("postgresql+psycopg://", "postgresql://", 1)
    before = _floor_databases()
    argv = ["pg_commit_floor", "--pg", server, "--calls", "5", "--rounds", "2", "--idle-ms", "0.5"]
    monkeypatch.setattr(sys, "argv", argv)
    pg_commit_floor.main()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("  ")]
    assert len(rows) == 14  # 7 writes, back to back and after idle
    for name in ("round trip (SELECT 1), after idle", "one-row INSERT, flushed, back to back",
                 "one-span batch, its rollout's next, not flushed, after idle", "one-span batch, a new rollout's, flushed"):
        line = next(line for line in rows if line.strip().startswith(name))
        assert len(re.findall(r"\d+\.\d{3}", line)) == 2  # one median per round
    for when in ("back to back", "after idle"):
        assert re.search(rf"^{when}: the least durable write [\d.]+-[\d.]+ ms, the store's one-span batch "
                         r"[\d.]+-[\d.]+ ms \(a new rollout's\)", out, flags=re.M)
    assert _floor_databases() == before
