"""Trace inspector page times: p50/p95 per page of ``/ui`` with ~100k spans in a SQLite store.

A page's time is the wall time of the requests its script makes (the HTML shell, then its JSON routes
one after another; the browser makes some of them in parallel, so this is an upper bound), measured by
an HTTP client against a real ``tracegym serve`` process on the store (upstream: an OpenAI-compatible URL
nobody listens on; the inspector reads only the store and the tokenizer). Each page is requested
``--rounds`` times with varied arguments (random rollouts, groups, filters); the first request of each
kind is a warm-up, reported on its own (the first ``has_errors``/``has_drift`` filter reads every span
once: ``FlaggedRollouts``).

The store is made once and kept (``--db``): 12,500 rollouts in GRPO groups of 4, 8 calls each (a tool
loop whose prompts grow to ~1,300 ids, messages in the request), 4% with a drifted call, 3% with an
errored call, 2% failed with a traceback, two training runs with metrics, 40 weight versions.

    python -m benchmarks.ui_pages [--spans 100000] [--rounds 40] [--db /tmp/tracegym-ui-bench.db]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.machine import describe
from tracegym.gateway.traces.call_spans import insert_call_records
from tracegym.gateway.traces.store import Store
from tracegym.procs import free_port, start_process
from tracegym.types import CallRecord, ChoiceRecord

TURNS = 8
GROUP = 4
VOCAB = 49_152
WORDS = ["alpha", "beta", "gamma", "delta", "add", "the", "numbers", "result", "tool", "call", "answer", "is", "sum", "of", "then", "check", "value", "weather", "city", "compute", "file", "search", "open", "read", "write", "error", "retry", "done"]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def make_calls(rid: str, task_id: str, rng: random.Random, t0_ns: int, version: str) -> list[CallRecord]:
    """A tool-using agent's 8 calls; one in 25 rollouts has a drifted call and one in 33 an errored one."""
    drift_at = rng.randrange(1, TURNS) if rng.random() < 0.04 else -1
    error_at = rng.randrange(TURNS) if rng.random() < 0.03 else -1
    messages: list[dict] = [{"role": "system", "content": "You are a careful agent. " + _text(rng, 40)},
                            {"role": "user", "content": f"Task {task_id}: " + _text(rng, 30)}]
    prompt = _ids(rng, 120)
    calls = []
    for i in range(TURNS):
        out = _ids(rng, rng.randint(30, 90))
        content = _text(rng, len(out) // 2)
        tool_call = {"id": f"call_{i}", "type": "function",
                     "function": {"name": "search", "arguments": f'{{"q": "{_text(rng, 3)}"}}'}}
        reply = {"role": "assistant", "content": content, "tool_calls": [tool_call] if i < TURNS - 1 else None}
        start = t0_ns + i * 700_000_000
        err = i == error_at
        calls.append(CallRecord(
            call_id=f"{rid}-c{i}", rollout_id=rid, operation="chat", model="bench", upstream_kind="sglang",
            request={"messages": list(messages), "tools": [{"type": "function", "function": {"name": "search"}}],
                     "temperature": 1.0, "max_tokens": 128},
            choices=[ChoiceRecord(0, None if err else out, None if err else [-rng.random() * 2 for _ in out],
                                  None if err else "tool_calls", None if err else reply)],
            prompt_ids=list(prompt), task_id=task_id, agent_name="agent", weight_version=version,
            drift=("realigned" if i == drift_at else "clean" if i else "none"), prefix_len=len(prompt) if i else 0,
            input_tokens=len(prompt), output_tokens=0 if err else len(out), start_time_ns=start,
            end_time_ns=start + 500_000_000, status="error" if err else "ok",
            error="upstream error: connection reset" if err else None))
        tool = _ids(rng, rng.randint(40, 80))
        prompt = prompt + out + tool
        messages += [reply, {"role": "tool", "tool_call_id": f"call_{i}", "content": _text(rng, 40)}]
    return calls


def build(path: Path, n_spans: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    store = Store.open(f"sqlite:///{path}")
    try:
        n_rollouts = n_spans // TURNS
        n_tasks = n_rollouts // GROUP
        t0 = time.perf_counter()
        for run in ("bench-a", "bench-b"):
            half = n_tasks // 2
            for block in range(0, half, 50):
                tasks = [{"task_id": f"{run}-t{block + k}", "input": {"q": _text(rng, 6)}, "split": "train"}
                         for k in range(min(50, half - block))]
                groups = store.enqueue_tasks(tasks, group_size=GROUP, max_attempts=1)
                version = str(block * 40 // half)
                calls = [c for g in groups for rid in g["rollout_ids"]
                         for c in make_calls(rid, g["task_id"], rng, time.time_ns(), version)]
                insert_call_records(store, calls)
                claimed = store.claim("bench-worker", limit=len(groups) * GROUP, lease_seconds=600)
                for r in claimed:
                    if rng.random() < 0.02:
                        store.fail(r["rollout_id"], worker_id="bench-worker", error="ValueError: bad tool",
                                   traceback="Traceback (most recent call last):\n  ...\nValueError: bad tool")
                    else:
                        store.complete(r["rollout_id"], worker_id="bench-worker", reward=float(rng.random() < 0.5))
                if block % 500 == 0:
                    print(f"  {run}: {block}/{half} tasks ({time.perf_counter() - t0:.0f}s)", flush=True)
            for step in range(1, 61):
                store.add_metrics(run, step, {"train/reward_mean": rng.random(), "train/loss": rng.random(),
                                              "train/kl": 0.0, "train/tokens_per_s": 300.0})
        for v in range(40):
            store.add_weight_version(str(v), step=v, swap_seconds=0.3)
    finally:
        store.close()


def _pages(rng: random.Random, rollouts: list[str], groups: list[str]) -> dict[str, list[tuple[str, dict]]]:
    """Each page's requests (path, params), with this round's random arguments."""
    rid, gid = rng.choice(rollouts), rng.choice(groups)
    common = [("/api/runs", {}), ("/api/weight_versions", {})]
    listing = "/api/inspect/rollouts"
    return {
        "runs": [("/ui", {}), *common, ("/api/runs/bench-b/metrics", {})],
        "rollouts": [("/ui/rollouts", {}), (listing, {"limit": 50}), *common],
        "rollouts: status=failed": [(listing, {"status": "failed", "limit": 50})],
        "rollouts: run + reward range": [(listing, {"run": "bench-a", "reward_min": 0.5, "limit": 50})],
        "rollouts: weight version": [(listing, {"weight_version": str(rng.randrange(40)), "limit": 50})],
        "rollouts: has_errors": [(listing, {"has_errors": "true", "limit": 50})],
        "rollouts: has_drift": [(listing, {"has_drift": "true", "limit": 50})],
        "rollouts: search id": [(listing, {"q": rid[-12:], "limit": 50})],
        "rollouts: search text": [(listing, {"q": rng.choice(WORDS) + " " + rng.choice(WORDS), "limit": 50})],
        "rollout": [(f"/ui/rollouts/{rid}", {}), (f"/api/inspect/rollouts/{rid}", {})],
        "group": [(f"/api/inspect/groups/{gid}", {})],
        "system": [("/api/inspect/system", {})],
    }


def measure(url: str, db: Path, rounds: int) -> None:
    store = Store.open(f"sqlite:///{db}", upgrade=False)
    try:
        rows = []
        cursor = None
        while True:
            page, cursor = store.list_rollouts(limit=5000, cursor=cursor)
            rows += page
            if cursor is None:
                break
    finally:
        store.close()
    rollouts = [r["rollout_id"] for r in rows]
    groups = sorted({r["group_id"] for r in rows if r["group_id"]})
    rng = random.Random(1)
    times: dict[str, list[float]] = {}
    first: dict[str, float] = {}
    with httpx.Client(base_url=url, timeout=60) as client:
        for i in range(rounds + 1):
            for name, requests in _pages(rng, rollouts, groups).items():
                t = time.perf_counter()
                for path, params in requests:
                    r = client.get(path, params=params)
                    r.raise_for_status()
                dt = time.perf_counter() - t
                if i == 0:
                    first[name] = dt
                else:
                    times.setdefault(name, []).append(dt)
    print(describe())
    print(f"{'page':32s} {'first':>8s} {'p50':>8s} {'p95':>8s}  (ms, {rounds} rounds)")
    for name, ts in times.items():
        p95 = statistics.quantiles(ts, n=20)[18] if len(ts) >= 2 else ts[0]
        print(f"{name:32s} {first[name] * 1e3:8.1f} {statistics.median(ts) * 1e3:8.1f} {p95 * 1e3:8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spans", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--db", type=Path, default=Path(tempfile.gettempdir()) / "tracegym-ui-bench.db")
    ap.add_argument("--rebuild", action="store_true", help="make the store again even if --db exists")
    args = ap.parse_args()
    if args.rebuild or not args.db.exists():
        for suffix in ("", "-wal", "-shm"):
            Path(f"{args.db}{suffix}").unlink(missing_ok=True)
        print(f"making {args.db} ({args.spans} spans)...", flush=True)
        t = time.perf_counter()
        build(args.db, args.spans)
        print(f"made in {time.perf_counter() - t:.0f}s", flush=True)
    port = free_port()
    argv = [sys.executable, "-m", "tracegym.cli", "serve", "--port", str(port), "--store", f"sqlite:///{args.db}",
            "--upstream", "http://127.0.0.1:9/v1", "--upstream-kind", "openai", "--model", "tiny-random",
            "--log-level", "warning"]
    with start_process(argv, port=port, log_path=args.db.with_suffix(".gateway.log"), health_path="/healthz",
                       timeout=120):
        measure(f"http://127.0.0.1:{port}", args.db, args.rounds)


if __name__ == "__main__":
    main()
