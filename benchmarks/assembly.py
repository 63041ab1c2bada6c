"""Trajectory assembly throughput: spans/s fetched from a SQLite store and assembled, and how the time
grows with the number of spans (printed as the ratio at 10x the size; linear is ~10). Times are this
process's CPU time (SQLite runs in-process), so a busy shared machine does not distort them.

Rollouts are realistic multi-turn agent runs: a ~300-token system+task prompt, then ``--turns`` calls,
each emitting ~100 sampled tokens followed by a ~150-token tool result, so prompts grow to ~2,000 ids.
They are inserted with ``insert_call_records`` (the gateway's own span rows), then read back the way
``GET /api/trajectories`` reads them: a page of rollouts (``list_rollouts``), their reward events in one
query (``list_events_many``), their spans in one query (``iter_token_calls``: the assembly's
``TokenCall``s, token columns kept as blobs, one rollout's calls built at a time), ``assemble_rollout``,
``check_invariants``, and the JSON line the route sends. ``fetch+assemble`` is the headline (the issue's
target); ``fetch (CallRecords)`` is the store's full read (lists, request bodies), for comparison, and the
``(calls read before)`` rows time the assembly alone. Like the gateway (``tracegym serve`` freezes its
startup heap), the measurement runs with the objects alive before it frozen (``gc.freeze``).

    python -m benchmarks.assembly [--rollouts 100] [--turns 8] [--scale 10] [--system-tokens 300] ...
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks.machine import describe
from tracegym.gateway.api.trajectories import trajectory_json
from tracegym.gateway.traces.assembly import AssemblyOptions, assemble_rollout, check_invariants
from tracegym.gateway.traces.call_spans import insert_call_records
from tracegym.gateway.traces.reads import iter_token_calls, list_call_records_many
from tracegym.gateway.traces.store import Store
from tracegym.types import CallRecord, ChoiceRecord

PAGE = 100


@dataclass(frozen=True)
class Shape:
    """Token counts of a synthetic rollout (outputs and tool results vary ±40% around the mean)."""

    turns: int = 8
    system: int = 300
    output: int = 100
    tool: int = 150


def _around(rng: random.Random, mean: int) -> int:
    return rng.randint(max(1, mean * 6 // 10), max(1, mean * 14 // 10))


def make_rollout(rid: str, shape: Shape, rng: random.Random) -> list[CallRecord]:
    prompt = [rng.randrange(50_000) for _ in range(shape.system)]
    messages: list[dict] = [{"role": "system", "content": "You are a tool-using agent. " * 20}]
    calls = []
    for i in range(shape.turns):
        out = [rng.randrange(50_000) for _ in range(_around(rng, shape.output))]
        lps = [-rng.random() * 3 for _ in out]
        calls.append(
            CallRecord(
                call_id=f"{rid}-{i}",
                rollout_id=rid,
                operation="chat",
                model="bench",
                upstream_kind="sglang",
                request={"messages": list(messages), "temperature": 1.0, "max_tokens": 256},
                choices=[
                    ChoiceRecord(0, out, lps, "tool_calls", {"role": "assistant", "content": "x" * 300})
                ],
                prompt_ids=list(prompt),
                agent_name="agent",
                weight_version="v3",
                input_tokens=len(prompt),
                output_tokens=len(out),
                start_time_ns=1_700_000_000_000_000_000 + i * 10**9,
                end_time_ns=1_700_000_000_000_000_000 + i * 10**9 + 5 * 10**8,
            )
        )
        tool = [rng.randrange(50_000) for _ in range(_around(rng, shape.tool))]
        prompt = prompt + out + tool
        messages += [{"role": "assistant", "content": "x" * 300}, {"role": "tool", "content": "y" * 600}]
    return calls


def fill(store: Store, n_rollouts: int, shape: Shape, seed: int) -> list[str]:
    rng = random.Random(seed)
    groups = store.enqueue_tasks([{"input": {"i": i}} for i in range(n_rollouts)])
    rids = [g["rollout_ids"][0] for g in groups]
    for start in range(0, n_rollouts, PAGE):
        batch = [c for rid in rids[start : start + PAGE] for c in make_rollout(rid, shape, rng)]
        insert_call_records(store, batch)
    for rid in rids[::2]:
        store.add_reward(rid, 1.0, idempotency_key=f"{rid}-r", name="tool_ok", call_index=1)
    return rids


def pages(store: Store) -> Iterator[list[dict]]:
    """All rollouts, a page at a time, the way ``GET /api/trajectories`` reads them."""
    cursor: str | None = None
    while True:
        rows, cursor = store.list_rollouts(limit=PAGE, cursor=cursor)
        yield rows
        if cursor is None:
            return


def run(store: Store, *, events: bool, check: bool, json: bool = False) -> tuple[float, int]:
    """(CPU seconds, spans) of one pass over the store as ``GET /api/trajectories`` reads it. CPU time of
    this process, not wall time: the machine may be shared, and SQLite runs in-process."""
    opts = AssemblyOptions()
    spans = 0
    t0 = time.process_time()
    for rows in pages(store):
        ids = [r["rollout_id"] for r in rows]
        evs = store.list_events_many(ids, kind="reward") if events else {}
        for row, (rid, cs) in zip(rows, iter_token_calls(store, ids), strict=True):
            traj = assemble_rollout(row, cs, evs.get(rid, []), opts)
            if check:
                check_invariants(cs, traj)
            if json:
                trajectory_json(traj)
            assert len(traj.sequences) == 1
            spans += len(cs)
    return time.process_time() - t0, spans


def assemble_only(store: Store, *, check: bool) -> float:
    """CPU seconds of assembling (and with ``check`` checking) every rollout, its calls read beforehand
    (untimed, all held in memory at once)."""
    opts = AssemblyOptions()
    work = []
    for rows in pages(store):
        calls = iter_token_calls(store, [r["rollout_id"] for r in rows])
        work += [(row, cs) for row, (_, cs) in zip(rows, calls, strict=True)]
    t0 = time.process_time()
    for row, cs in work:
        traj = assemble_rollout(row, cs, (), opts)
        if check:
            check_invariants(cs, traj)
    return time.process_time() - t0


def fetch_only(store: Store, rids: list[str], records: bool = False) -> tuple[float, int]:
    """(CPU seconds, spans) of reading every rollout's calls: ``TokenCall``s (the assembly's read), or
    with ``records`` whole ``CallRecord``s with their request bodies (the store's full read)."""
    t0 = time.process_time()
    n = 0
    for start in range(0, len(rids), PAGE):
        ids = rids[start : start + PAGE]
        if records:
            n += sum(len(v) for v in list_call_records_many(store, ids).values())
        else:
            n += sum(len(calls) for _, calls in iter_token_calls(store, ids))
    return time.process_time() - t0, n


def measure(store: Store, rids: list[str]) -> dict[str, float]:
    """CPU seconds of each measured path over the whole store."""
    r: dict[str, float] = {}
    r["fetch (CallRecords)"], _ = fetch_only(store, rids, records=True)
    r["fetch"], _ = fetch_only(store, rids)
    r["fetch+assemble"], _ = run(store, events=False, check=False)
    r["assemble (calls read before)"] = assemble_only(store, check=False)
    r["fetch+events+assemble+check"], _ = run(store, events=True, check=True)
    r["assemble+check (calls read before)"] = assemble_only(store, check=True)
    r["... +json (the route's work)"], _ = run(store, events=True, check=True, json=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=100)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=300, help="first prompt length")
    ap.add_argument("--output-tokens", type=int, default=100, help="mean sampled tokens per call")
    ap.add_argument("--tool-tokens", type=int, default=150, help="mean tool-result tokens per turn")
    ap.add_argument("--scale", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5, help="measure each size this often, keep the best")
    args = ap.parse_args()
    shape = Shape(args.turns, args.system_tokens, args.output_tokens, args.tool_tokens)
    sizes = {"1x": args.rollouts, f"{args.scale}x": args.rollouts * args.scale}
    best: dict[str, dict[str, float]] = {}
    spans: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        stores = {label: Store.open(f"sqlite:///{Path(tmp) / f'{label}.db'}") for label in sizes}
        try:
            rids = {}
            for label, n in sizes.items():
                t0 = time.perf_counter()
                rids[label] = fill(stores[label], n, shape, seed=n)
                spans[label] = fetch_only(stores[label], rids[label])[1]
                print(
                    f"[{label}] {n} rollouts x {args.turns} turns = {spans[label]} spans, "
                    f"inserted in {time.perf_counter() - t0:.1f}s"
                )
            # As `tracegym serve` does once it has started (GatewaySettings.freeze_gc): the objects alive now
            # (modules, stores) leave the collector's generations, so its full collections scan only what
            # the measured reads allocate, not this process's setup.
            gc.collect()
            gc.freeze()
            for _ in range(args.rounds):  # sizes interleaved, so a busy moment hits both alike
                for label in sizes:
                    for key, t in measure(stores[label], rids[label]).items():
                        best.setdefault(label, {})[key] = min(t, best.get(label, {}).get(key, t))
        finally:
            for store in stores.values():
                store.close()
    (small, s_n), (big, b_n) = ((best[k], spans[k]) for k in sizes)
    print(describe())
    print(
        f"CPU spans/s (best of {args.rounds}); time ratio at {b_n / s_n:.0f}x the spans (linear = {b_n / s_n:.0f}):"
    )
    print(f"  {'path':36s} {'1x':>10s} {f'{args.scale}x':>10s} {'ratio':>7s}")
    for key in small:
        print(f"  {key:36s} {s_n / small[key]:10,.0f} {b_n / big[key]:10,.0f} {big[key] / small[key]:7.2f}")


if __name__ == "__main__":
    main()
