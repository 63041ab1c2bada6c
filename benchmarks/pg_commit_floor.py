"""What any durable write costs on a PostgreSQL server, beside the store's one-span commit: the floor under
what ``--durability commit`` adds to a call alone (c=1) on that server.

    python -m benchmarks.pg_commit_floor [--pg postgresql://127.0.0.1:5432/test] [--calls 400] [--rounds 3]

On a database of its own (made, then dropped), each round measures, one after another, the median of
``--calls`` of each:

- a round trip: ``SELECT 1``;
- the least a durable write can be: a one-row INSERT of a short text into a table with one index, in its own
  transaction, committed with ``synchronous_commit`` on (the server flushes its WAL before it answers), and
  the same with it off (no flush waited for);
- the store's one-span batch (``Store.insert_spans`` of one call's span, with a rollout of its own: one
  statement on the span writer's connection), the same two ways.

A call that is answered only once its span is committed waits at least for the committed one-row INSERT, on
top of its hand-offs to the thread that writes and back; a target for commit mode's added latency below that
INSERT cannot be met on that server, whatever the gateway does. ``pg_test_fsync`` (PostgreSQL's own tool)
gives the disk's flush alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable

from benchmarks.gateway_overhead import _pg_database, _pg_url
from benchmarks.machine import describe
from benchmarks.store_ingest import make_records
from tracegym.gateway.traces.call_spans import call_batch
from tracegym.gateway.traces.store import Store


def _median_ms(calls: int, step: Callable[[int], object]) -> float:
    times = []
    for i in range(calls):
        t = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _round(store: Store, raw: object, batches: list, calls: int) -> dict[str, float]:
    import psycopg

    assert isinstance(raw, psycopg.Connection)
    spans = iter(batches)

    def one_span(_: int) -> None:
        store.insert_spans(next(spans))

    def synchronous(on: bool) -> None:
        value = "on" if on else "off"
        raw.execute(f"SET synchronous_commit = {value}")
        with store.db.span_write() as writer:
            writer.execute(f"SET synchronous_commit = {value}")

    out = {"round trip (SELECT 1)": _median_ms(calls, lambda _: raw.execute("SELECT 1").fetchone())}
    for on in (True, False):
        synchronous(on)
        flush = "flushed" if on else "not flushed"
        out[f"one-row INSERT, {flush}"] = _median_ms(
            calls, lambda _: raw.execute("INSERT INTO floor_probe (v) VALUES (%s)", ("a short text",)))
        out[f"store's one-span batch, {flush}"] = _median_ms(calls, one_span)
    synchronous(True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pg", default="postgresql://127.0.0.1:5432/test", metavar="URL",
                   help="a PostgreSQL server (the benchmark makes a database of its own there)")
    p.add_argument("--calls", type=int, default=400, help="writes of each kind a round (the median is printed)")
    p.add_argument("--rounds", type=int, default=3)
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
            records = make_records(2 * a.calls * a.rounds, n_rollouts=2 * a.calls * a.rounds)
            batches = [call_batch([r]) for r in records]
            store.insert_spans(call_batch(make_records(1, seed=1)))  # the writer connection and its statements
            rounds = [_round(store, raw, batches[2 * a.calls * k:2 * a.calls * (k + 1)], a.calls)
                      for k in range(a.rounds)]
            size = raw.execute("SELECT pg_column_size(s.*) FROM spans s LIMIT 1").fetchone()[0]
        finally:
            raw.close()
            store.close()
    finally:
        _pg_database(a.pg, database, drop=True)
    print(f"medians of {a.calls} each, per round (ms); a stored span row is {size} bytes")
    for name in rounds[0]:
        print(f"  {name:38s} " + "  ".join(f"{r[name]:6.3f}" for r in rounds))
    floor = [r["one-row INSERT, flushed"] for r in rounds]
    span = [r["store's one-span batch, flushed"] for r in rounds]
    flush = [r["one-row INSERT, flushed"] - r["one-row INSERT, not flushed"] for r in rounds]
    print(f"the least durable write: {min(floor):.3f}-{max(floor):.3f} ms (of it the WAL flush "
          f"{min(flush):.3f}-{max(flush):.3f} ms); the store's one-span batch {min(span):.3f}-{max(span):.3f} ms, "
          f"{min(s / f for s, f in zip(span, floor, strict=True)):.2f}-"
          f"{max(s / f for s, f in zip(span, floor, strict=True)):.2f}x the least durable write")


if __name__ == "__main__":
    main()
