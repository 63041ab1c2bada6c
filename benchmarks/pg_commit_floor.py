"""What any durable write costs on a PostgreSQL server, beside the store's one-span commit: the floor under
what ``--durability commit`` adds to a call alone (c=1) on that server.

    python -m benchmarks.pg_commit_floor [--pg postgresql://127.0.0.1:5432/test] [--calls 300] [--rounds 3]
                                         [--idle-ms 2.5]

On a database of its own (made, then dropped), each round measures the median of ``--calls`` of each:

- a round trip: ``SELECT 1``;
- the least a durable write can be: a one-row INSERT of a short text into a table with one index, in its own
  transaction, committed with ``synchronous_commit`` on (the server flushes its WAL before it answers), and
  the same with it off (no flush waited for);
- the store's one-span batch (``Store.insert_spans`` of one call's span: one statement on the span writer's
  connection), for a span of a new rollout (a call of no rollout gets an ad-hoc one of its own; an agent run's
  first call) and for a later span of its rollout, the same two ways;

each back to back, and after ``--idle-ms`` of idleness before each: as a call alone finds the server, asleep
since the last call's commit (2.5 ms is about a call's cycle at c=1 through the gateway in commit mode); on a
virtual machine, waking its processes can cost as much as the work.

A call that is answered only once its span is committed waits at least for the committed one-row INSERT after
an idle pause, on top of its hand-offs to the thread that writes and back; a target for commit mode's added
latency at c=1 below that INSERT cannot be met on that server, whatever the gateway does. ``pg_test_fsync``
(PostgreSQL's own tool) gives the disk's flush alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

from benchmarks.gateway_overhead import _pg_database, _pg_url
from benchmarks.machine import describe
from benchmarks.store_ingest import make_records
from tracegym.gateway.traces.call_spans import call_batch
from tracegym.gateway.traces.store import Store
from tracegym.gateway.traces.store.span_rows import SpanBatch

ROUND_TRIP = "round trip (SELECT 1)"
LEAST = "one-row INSERT"
SPAN_NEW = "one-span batch, a new rollout's"
SPAN_LATER = "one-span batch, its rollout's next"


def _median_ms(calls: int, idle_s: float, step: Callable[[], object]) -> float:
    times = []
    for _ in range(calls):
        if idle_s:
            time.sleep(idle_s)
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _synchronous(store: Store, raw: Any, on: bool) -> None:
    value = "on" if on else "off"
    raw.execute(f"SET synchronous_commit = {value}")
    with store.db.span_write() as writer:
        writer.execute(f"SET synchronous_commit = {value}")


def _round(store: Store, raw: Any, spans: dict[str, list[SpanBatch]], calls: int, idle_s: float
           ) -> dict[str, float]:
    """One round's medians (ms) by ``what, flushed or not, back to back or after idleness``."""
    out: dict[str, float] = {}
    pending = {name: iter(batches) for name, batches in spans.items()}
    for idle in (0.0, idle_s):
        when = "after idle" if idle else "back to back"
        out[f"{ROUND_TRIP}, {when}"] = _median_ms(calls, idle, lambda: raw.execute("SELECT 1").fetchone())
        for on in (True, False):
            _synchronous(store, raw, on)
            flush = "flushed" if on else "not flushed"
            out[f"{LEAST}, {flush}, {when}"] = _median_ms(
                calls, idle, lambda: raw.execute("INSERT INTO floor_probe (v) VALUES (%s)", ("a short text",)))
            for name, batches in pending.items():
                out[f"{name}, {flush}, {when}"] = _median_ms(
                    calls, idle, lambda batches=batches: store.insert_spans(next(batches)))
        _synchronous(store, raw, True)
    return out


def _spans(n: int, seed: int) -> dict[str, list[SpanBatch]]:
    """``n`` one-span batches of each kind: the first span of a rollout of its own, and a second span of each
    of those rollouts (its version unchanged), in the order they are written."""
    first, later = make_records(n, n_rollouts=n, seed=seed), make_records(n, n_rollouts=n, seed=seed)
    for i, (a, b) in enumerate(zip(first, later, strict=True)):
        a.rollout_id = b.rollout_id = f"ro-floor-{seed}-{i}"
        a.call_id, b.call_id = f"chatcmpl-floor-{seed}-{i}-0", f"chatcmpl-floor-{seed}-{i}-1"
    return {SPAN_NEW: [call_batch([r]) for r in first], SPAN_LATER: [call_batch([r]) for r in later]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pg", default="postgresql://127.0.0.1:5432/test", metavar="URL",
                   help="a PostgreSQL server (the benchmark makes a database of its own there)")
    p.add_argument("--calls", type=int, default=300, help="writes of each kind a round (the median is printed)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--idle-ms", type=float, default=2.5, help="the pause before each write, after idleness")
    a = p.parse_args()
    import psycopg

    print(describe())
    database = f"tg_floor_{uuid.uuid4().hex[:8]}"
    _pg_database(a.pg, database)
    url = _pg_url(a.pg, database)
    try:
        store = Store.open(url.replace("postgresql://", "postgresql+psycopg://", 1))
        raw = psycopg.connect(url, autocommit=True)
        try:
            raw.execute("CREATE TABLE floor_probe (id bigserial PRIMARY KEY, v text)")
            store.insert_spans(call_batch(make_records(1, seed=-1)))  # the writer connection and its statements
            rounds = [_round(store, raw, _spans(4 * a.calls, seed=k), a.calls, a.idle_ms / 1e3)
                      for k in range(a.rounds)]
            size, stored = raw.execute("SELECT max(pg_column_size(s.*)), count(*) FROM spans s").fetchone()
            if stored != 1 + 8 * a.calls * a.rounds:  # each batch a new span: none skipped as stored already
                raise SystemExit(f"{stored} spans stored, {1 + 8 * a.calls * a.rounds} written")
        finally:
            raw.close()
            store.close()
    finally:
        _pg_database(a.pg, database, drop=True)
    print(f"medians of {a.calls} each, per round (ms), back to back and after {a.idle_ms:g} ms idle before each; "
          f"a stored span row is up to {size} bytes")
    for name in rounds[0]:
        print(f"  {name:60s} " + "  ".join(f"{r[name]:6.3f}" for r in rounds))

    def spread(key: str) -> str:
        values = [r[key] for r in rounds]
        return f"{min(values):.3f}-{max(values):.3f} ms"

    for when in ("back to back", "after idle"):
        print(f"{when}: the least durable write {spread(f'{LEAST}, flushed, {when}')}, the store's one-span batch "
              f"{spread(f'{SPAN_NEW}, flushed, {when}')} (a new rollout's), "
              f"{spread(f'{SPAN_LATER}, flushed, {when}')} (its rollout's next)")


if __name__ == "__main__":
    main()
