"""Span ingest throughput into the trace store through the real recording path:
CallRecord -> TraceRecorder.record (enqueue) -> export thread (CallSpan + encoded row) -> StoreSpanExporter
-> Store.insert_spans, with realistic records (~300 prompt ids, ~100 output ids + logprobs, a few messages).

Prints, for SQLite and (when reachable) PostgreSQL in one run:
- end to end: spans/s from the first ``record()`` until ``shutdown()`` returned, with the stored rows
  counted by SQL afterwards, and the ratio to the target (30,000/s SQLite, 10,000/s PostgreSQL);
- the CPU cost per span of that run (this process, plus the PostgreSQL backend's), i.e. the rate a
  machine with a free core per process would reach: wall numbers depend on the load (printed);
- the store insert alone (pre-encoded batches) for comparison;
and the cost of one ``record()`` call on the request path (µs, wall and CPU; target: a few µs).

    python -m benchmarks.store_ingest [--spans 20000] [--batch 2000] [--no-pg]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from array import array
from pathlib import Path

from benchmarks.machine import describe
from tracegym.gateway.settings import SERVE_SWITCH_INTERVAL_S
from tracegym.gateway.traces.call_spans import call_batch, insert_call_records
from tracegym.gateway.traces.recorder import TraceRecorder
from tracegym.gateway.traces.store import Store
from tracegym.gateway.traces.store.span_rows import SpanBatch
from tracegym.types import CallRecord, ChoiceRecord, WeightVersionSpan

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
TARGETS = {"sqlite": 30_000, "postgresql": 10_000}


def make_records(n: int, n_rollouts: int = 200, seed: int = 0) -> list[CallRecord]:
    rng = random.Random(seed)
    prompt = [rng.randrange(49152) for _ in range(300)]
    msgs = [
        {"role": "system",
         "content": "You are a careful assistant that solves arithmetic puzzles step by step."},
        {"role": "user", "content": "A farmer has 17 sheep; all but 9 run away. How many are left? " * 3},
        {"role": "assistant", "content": "Let me think about it. 'All but 9' means 9 stay."},
        {"role": "user", "content": "Explain once more, briefly."},
    ]
    t0 = time.time_ns()
    recs = []
    for i in range(n):
        out = [rng.randrange(49152) for _ in range(100)]
        lps = [float(array("f", [-rng.random() * 3])[0]) for _ in range(100)]  # engines sample in fp32
        recs.append(CallRecord(
            call_id=f"chatcmpl-{i:08d}", rollout_id=f"ro-bench-{i % n_rollouts}", operation="chat",
            model="smollm2-135m", upstream_kind="sglang",
            request={"model": "smollm2-135m", "messages": msgs, "temperature": 0.8, "max_tokens": 128},
            choices=[ChoiceRecord(0, out, lps, "stop", {"role": "assistant", "content": "9 sheep are left."},
                                  [WeightVersionSpan("v3", 0, 100)])],
            prompt_ids=list(prompt), task_id=f"task-{i % n_rollouts}", weight_version="v3", drift="clean",
            prefix_len=200, input_tokens=300, output_tokens=100,
            start_time_ns=t0 + i * 1000, end_time_ns=t0 + i * 1000 + 500,
        ))
    return recs


def _proc_cpu(path: str) -> float:
    """utime + stime seconds from a /proc/.../stat file (0 when it is not readable)."""
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:  # not on this machine (remote server), or the thread has ended
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Cpu:
    """CPU seconds of this process, of the recorder's build and write threads, and, for PostgreSQL, of the
    store's server backends (all via /proc)."""

    def __init__(self, store: Store, threads: list[threading.Thread]) -> None:
        self.tids = [t.native_id for t in threads]
        self.threads0 = [_proc_cpu(f"/proc/self/task/{tid}/stat") for tid in self.tids]
        self.pids: list[int] = []
        if store.dialect == "postgresql":
            with store.db.engine.connect() as conn:
                self.pids = [r[0] for r in conn.exec_driver_sql(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database()")]
        self.server0 = self._server()
        self.own0 = time.process_time()

    def _server(self) -> float:
        return sum(_proc_cpu(f"/proc/{pid}/stat") for pid in self.pids)

    def threads(self) -> list[float]:
        """CPU seconds of each thread so far (read before the threads end)."""
        return [_proc_cpu(f"/proc/self/task/{tid}/stat") - t0
                for tid, t0 in zip(self.tids, self.threads0, strict=True)]

    def done(self) -> tuple[float, float]:
        return time.process_time() - self.own0, self._server() - self.server0


def _count(store: Store) -> int:
    with store.db.engine.connect() as conn:
        return conn.exec_driver_sql("SELECT count(*) FROM spans").scalar_one()


def bench_end_to_end(store: Store, recs: list[CallRecord], batch: int) -> dict[str, float]:
    """Wall spans/s and CPU µs per span: whole process, the record() loop, encoding (build thread plus
    the main thread's share: ``force_flush`` encodes what is left in the caller's thread), the write
    thread, and the database server."""
    # Warm the pool connection the exporter will use with one real write transaction (an empty batch writes
    # nothing): the first transaction on a connection pays one-time costs (SQLAlchemy's first BEGIN and
    # COMMIT on it, preparing the small statements) that a running gateway has long paid.
    insert_call_records(store, recs[:1])
    before = _count(store)
    rec = TraceRecorder(store, max_queue_size=len(recs) + 1, max_batch_size=batch)
    proc = rec.processor
    cpu = _Cpu(store, [proc._builder, proc._writer])
    t, main0 = time.perf_counter(), time.thread_time()
    for r in recs:
        rec.record(r)
    main1 = time.thread_time()
    rec.force_flush()
    main2 = time.thread_time()
    build, write = cpu.threads()
    rec.shutdown()
    dt = time.perf_counter() - t
    own, server = cpu.done()
    stored = _count(store) - before
    assert stored == len(recs), f"{len(recs) - stored} spans were lost"
    us = 1e6 / len(recs)
    return {"rate": len(recs) / dt, "own": own * us, "record": (main1 - main0) * us,
            "build": (build + main2 - main1) * us, "write": write * us, "server": server * us}


def bench_record_call(recs: list[CallRecord]) -> tuple[float, float]:
    """µs per ``record()`` (wall, CPU) with the export thread idle (it runs after the loop)."""

    class NullStore:
        def insert_spans(self, rows: SpanBatch | list[dict]) -> int:
            return len(rows)

    rec = TraceRecorder(NullStore(), max_queue_size=len(recs) + 1, max_batch_size=len(recs) + 1,
                        schedule_delay_s=3600)
    t, c = time.perf_counter(), time.process_time()
    for r in recs:
        rec.record(r)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    rec.shutdown()
    return wall / len(recs) * 1e6, cpu / len(recs) * 1e6


def bench_insert_only(store: Store, recs: list[CallRecord], batch: int) -> float:
    batches = [call_batch(recs[i : i + batch]) for i in range(0, len(recs), batch)]
    t = time.perf_counter()
    for b in batches:
        store.insert_spans(b)
    return len(recs) / (time.perf_counter() - t)


def _pg_url() -> str | None:
    try:
        import psycopg

        name = f"tg_bench_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    except Exception as e:  # the benchmark just skips PostgreSQL when it is not there
        print(f"PostgreSQL unavailable ({e}); skipping it")
        return None


def _drop_pg(url: str) -> None:
    import psycopg

    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spans", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=2_000, help="max_batch_size of the recorder")
    ap.add_argument("--no-pg", action="store_true")
    ap.add_argument("--switch-interval", type=float, default=SERVE_SWITCH_INTERVAL_S,
                    help="sys.setswitchinterval, seconds "
                         "(default: what `tracegym serve` sets; Python's is 0.005)")
    args = ap.parse_args()
    # As in `tracegym serve` (GatewaySettings.switch_interval_s): the write thread gets the GIL back sooner
    # after each SQLite statement.
    sys.setswitchinterval(args.switch_interval)
    recs = make_records(args.spans)
    recs2 = make_records(args.spans, seed=1)
    # The premade input (2 x 20,000 records, ~10 containers each) is frozen out of the collector's
    # generations: in the gateway each record is built by its request and freed once exported, so full
    # collections rescanning the whole input set here would measure this benchmark's setup, not the path.
    gc.collect()
    gc.freeze()
    print(f"{args.spans} spans, 300 prompt ids, 100 output ids + logprobs, 4 messages each; "
          f"batches of {args.batch}; switch interval {sys.getswitchinterval() * 1e3:g} ms; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    wall_us, cpu_us = bench_record_call(recs)
    print(f"record() call: {wall_us:6.2f} µs wall, {cpu_us:6.2f} µs CPU (request path: enqueue only)")
    tmp = Path(tempfile.mkdtemp(prefix="tg-ingest-"))
    urls = {"sqlite": f"sqlite:///{tmp / 'bench.db'}"}
    if not args.no_pg and (pg := _pg_url()):
        urls["postgresql"] = pg
    for name, url in urls.items():
        store = Store.open(url)
        try:
            e = bench_end_to_end(store, recs, args.batch)
            ins = bench_insert_only(store, recs2, args.batch)
            target = TARGETS[name]
            serial = 1e6 / max(e["own"], e["server"])
            stage = 1e6 / max(e["build"] + e["record"], e["write"], e["server"])
            print(f"{name:10s} end to end {e['rate']:8.0f} spans/s = {e['rate'] / target:4.2f}x target "
                  f"{target}/s; store insert alone (pre-encoded) {ins:8.0f}/s")
            print(f"{'':10s} CPU µs/span: process {e['own']:5.1f} (record() {e['record']:4.1f}, encode "
                  f"{e['build']:5.1f}, write thread {e['write']:5.1f}), db server {e['server']:5.1f} "
                  f"-> CPU-bound rate {serial:7.0f}/s ({serial / target:4.2f}x) on one core, {stage:7.0f}/s "
                  f"({stage / target:4.2f}x) with a core per stage (GIL permitting)")
        finally:
            store.close()
            if name == "postgresql":
                _drop_pg(url)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}; {describe()}")


if __name__ == "__main__":
    main()
