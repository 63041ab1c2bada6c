"""Several engines behind one gateway (``gateway/proxy/upstream/fleet.py``), side by side in one run:

1. throughput: chat calls attributed to ``--rollouts`` rollouts (so both engines get some) through a
   gateway with 1 zero-latency SGLang fake and through one with 2, at c=1 (p50) and c=32 (req/s),
   alternating ``--repeat`` times; with ``--baseline-pythonpath DIR`` also a gateway run from other code
   (e.g. the commit before the fleet, see below) in front of 1 fake, for the one-engine overhead;
2. swap time: ``POST /api/weights/update`` of the model's own directory into a fleet of 1 and of 2
   embedded engines (``tracegym engine --model``, real loads), alternating ``--swaps`` times: the gateway's
   ``swap_seconds`` (pause → load on every engine → continue), medians.

    python -m benchmarks.fleet [--requests 2000] [--repeat 3] [--rollouts 64] [--swaps 5]
                               [--model tiny-random] [--baseline-pythonpath DIR] [--skip-swap]

A baseline from another commit: ``git archive COMMIT | tar -x -C /tmp/base`` and a directory whose
``tracegym`` package is that commit's ``sdk/`` with ``gateway``/``trainer`` linked in (PYTHONPATH comes
before the editable install)."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.gateway_overhead import ROLLOUT, _bodies, _run_load, _tokenizer_dir
from tracegym.procs import ManagedProcess, free_port, start_process

REPO = Path(__file__).resolve().parents[1]


def _fake(tmp: Path, tok: Path) -> ManagedProcess:
    port = free_port()
    return start_process([sys.executable, "-m", "benchmarks.fake_sglang", "--port", str(port), "--tokenizer",
                          str(tok)], port=port, log_path=tmp / f"fake-{port}.log", cwd=REPO, timeout=120)


def _gateway(tmp: Path, tok: Path, upstreams: list[str], name: str, pythonpath: str | None = None) -> ManagedProcess:
    port = free_port()
    argv = [sys.executable, "-m", "tracegym.cli", "serve", "--port", str(port), "--model", str(tok), "--store",
            f"sqlite:///{tmp / (name + '.db')}", "--log-level", "warning"]
    for u in upstreams:
        argv += ["--upstream", u]
    env = {"PYTHONPATH": pythonpath} if pythonpath else None
    return start_process(argv, port=port, health_path="/healthz", log_path=tmp / f"{name}.log", cwd=REPO,
                         timeout=180, env=env)


def throughput(a: argparse.Namespace, tmp: Path, tok: Path) -> None:
    with _fake(tmp, tok) as f1, _fake(tmp, tok) as f2:
        gws = {"1 engine": _gateway(tmp, tok, [f1.base_url], "one"),
               "2 engines": _gateway(tmp, tok, [f1.base_url, f2.base_url], "two")}
        if a.baseline_pythonpath:
            gws["1 engine, baseline code"] = _gateway(tmp, tok, [f1.base_url], "base", a.baseline_pythonpath)
        body, path = _bodies("chat", str(tok), distinct=False)
        points: dict[str, dict[int, list[dict]]] = {k: {1: [], 32: []} for k in gws}
        try:
            for r in range(a.repeat):
                for c in (1, 32):
                    n = a.requests if c > 1 else max(500, a.requests // 4)
                    order = list(gws.items())
                    order = order[r % len(order):] + order[: r % len(order)]  # no gateway always first
                    for name, gw in order:
                        url = f"{gw.base_url}/rollouts/bench-{ROLLOUT}/v1{path}"
                        res = _run_load(url, body, c, n, tmp, [], a.rollouts)
                        points[name][c].append(res)
                        print(f"round {r + 1} c={c:<3} {name:24} {res['rps']:>8.0f} req/s  p50 {res['p50_ms']:.3f} ms"
                              f"  p99 {res['p99_ms']:.3f} ms  errors {res['errors']}", flush=True)
            fleet = httpx.get(gws["2 engines"].base_url + "/api/upstreams", timeout=30).json()
            served = [e["calls"] for e in fleet["engines"]]
        finally:
            for gw in gws.values():
                gw.stop()
    med = statistics.median
    print("\nmedians over", a.repeat, "rounds (gateway req/s at c=32, p50 ms at c=1):")
    for name, pts in points.items():
        print(f"  {name:24} {med(p['rps'] for p in pts[32]):>8.0f} req/s   p50 {med(p['p50_ms'] for p in pts[1]):.3f} ms")
    one, two = points["1 engine"], points["2 engines"]
    print(f"  2 engines / 1 engine: req/s {med(p['rps'] for p in two[32]) / med(p['rps'] for p in one[32]):.2f}x, "
          f"p50 at c=1 {med(p['p50_ms'] for p in two[1]) - med(p['p50_ms'] for p in one[1]):+.3f} ms")
    if "1 engine, baseline code" in points:
        base = points["1 engine, baseline code"]
        print(f"  1 engine, this code vs baseline: p50 at c=1 "
              f"{med(p['p50_ms'] for p in one[1]) - med(p['p50_ms'] for p in base[1]):+.3f} ms, req/s at c=32 "
              f"{med(p['rps'] for p in one[32]) / med(p['rps'] for p in base[32]):.2f}x")
    print(f"  calls per engine of the 2-engine gateway (rollouts by rendezvous hash): {served}")


def _engine(tmp: Path, model: str) -> ManagedProcess:
    port = free_port()
    return start_process(["tracegym", "engine", "--model", model, "--port", str(port), "--log-level", "warning"],
                         port=port, log_path=tmp / f"engine-{port}.log", timeout=900,
                         env={"TRACEGYM_ENGINE_THREADS": "1"})


def swap_time(a: argparse.Namespace, tmp: Path, tok: Path) -> None:
    from tracegym.models import find_local_model_dir

    weights = find_local_model_dir(a.model)
    if weights is None:
        raise SystemExit(f"no local directory for {a.model}: run `tracegym models prepare {a.model}`")
    with _engine(tmp, a.model) as e1, _engine(tmp, a.model) as e2:
        gws = {"1 engine": _gateway(tmp, tok, [e1.base_url], "swap1"),
               "2 engines": _gateway(tmp, tok, [e1.base_url, e2.base_url], "swap2")}
        seconds: dict[str, list[float]] = {k: [] for k in gws}
        try:
            for i in range(a.swaps):
                for name, gw in gws.items():
                    t0 = time.perf_counter()
                    r = httpx.post(gw.base_url + "/api/weights/update", timeout=600,
                                   json={"model_path": str(weights), "weight_version": f"{name[0]}-{i}"})
                    wall = time.perf_counter() - t0
                    out = r.json()
                    assert r.status_code == 200 and out["success"], r.text
                    seconds[name].append(out["swap_seconds"])
                    print(f"swap {i + 1} {name:10} swap_seconds {out['swap_seconds']:.3f}  wall {wall:.3f}", flush=True)
        finally:
            for gw in gws.values():
                gw.stop()
    med = statistics.median
    m1, m2 = med(seconds["1 engine"]), med(seconds["2 engines"])
    print(f"\nswap of {a.model} ({weights}), medians of {a.swaps}: 1 engine {m1:.3f} s, 2 engines {m2:.3f} s "
          f"({m2 / m1:.2f}x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rollouts", type=int, default=64)
    p.add_argument("--swaps", type=int, default=5)
    p.add_argument("--model", default="tiny-random", help="the embedded engines' model for the swap part")
    p.add_argument("--baseline-pythonpath", default=None, help="run a third gateway from this code (1 engine)")
    p.add_argument("--skip-swap", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    a = p.parse_args()
    tok = _tokenizer_dir(None)
    tmp = Path(tempfile.mkdtemp(prefix="tg-fleet-"))
    print(f"load average {Path('/proc/loadavg').read_text().split()[0]} on {os.cpu_count()} cores")
    try:
        if not a.skip_throughput:
            throughput(a, tmp, tok)
        if not a.skip_swap:
            swap_time(a, tmp, tok)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average {Path('/proc/loadavg').read_text().split()[0]} at the end")


if __name__ == "__main__":
    main()
