"""Gateway overhead: the same load sent straight to a zero-latency SGLang fake and through the gateway,
in one run, side by side. Prints p50/p99 latency and the added latency at concurrency 1 and 32, and req/s.

    python -m benchmarks.gateway_overhead [--store sqlite|none] [--requests 2000]
                                          [--op chat|completion|responses|messages] [--stream]
                                          [--apis] [--distinct] [--rollouts K] [--pin] [--durability-both]
                                          [--durability commit|async] [--pg URL]

Processes: the fake (benchmarks/fake_sglang.py), the gateway (``tracegym serve``, one uvicorn worker,
uvloop + httptools) and an aiohttp load generator (``loadgen`` mode of this script) each run on their
own. Direct requests are the ``/generate`` body the gateway itself sends for the same chat call, so the
difference is the gateway's work: parsing, chat templating + tokenizing, prefix planning, the upstream
hop, decoding, response building and (with ``--store sqlite``) recording the span.
``--distinct`` makes every chat request's user message unique (no render/encode cache hits for it: the
realistic multi-turn case; the default repeats one prompt, like the members of a GRPO group).
``--rollouts K`` sends the chat calls to ``/rollouts/bench-{i % K}/v1/...``: attributed calls, as the runner's
agents make them, which the per-rollout prefix cache plans and remembers.
``--pin`` pins the gateway to CPU 0 and the fake and the load generator to CPU 1 (``taskset``), so the
gateway is one worker on one core. With recording on, the run ends by checking that the store holds one
span per request sent through the gateway (warm-up included) and exits 1 if not.
``--op responses|messages`` sends the same chat call through ``/v1/responses`` or ``/v1/messages``
(instructions/system + one user message: the same prompt ids, so the same direct baseline); ``--stream``
streams both sides (the direct side as SGLang's stream). ``--apis`` runs chat, Responses and Messages,
non-stream and stream, on one gateway in one run, ``--repeat R`` times in rotation (chat, Responses,
Messages, chat, …: the shared machines drift within minutes, so each API's points are taken alongside
chat's), and ends with each API's median added p50 at c=1, c=32 throughput and gateway CPU per request,
as ratios to chat's (same mode).
``--durability-both`` runs two gateways side by side, ``--durability commit`` (the default: a call is
answered once its span is committed) and ``--durability async`` (answered at once, the span written later),
each on its own SQLite store (``--pg URL``: each on a database of its own made on that PostgreSQL server and
dropped after), and alternates direct / commit / async at each point ``--repeat`` times; it ends with each
mode's median added p50 at c=1 and req/s at c=32.
Targets: p50 added ≤ 1 ms at c=1; ≥ 2,000 req/s at c=32; stored spans == requests; with ``--apis``,
added p50 within 1.2× of chat's and c=32 throughput ≥ 0.8× chat's."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from tracegym.procs import ManagedProcess, free_port, start_process

REPO = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "system", "content": "You are a careful math tutor."},
            {"role": "user", "content": "What is 2+3? Answer with one short sentence."}]


# ---------------------------------------------------------------------------------------- load generator

VARY = b"@@N@@"  # replaced by a request counter in every request (``--distinct``)
ROLLOUT = "@@R@@"  # replaced in the URL by the request counter modulo ``--rollouts``


async def _load(url: str, body: bytes, concurrency: int, n: int, warmup: int, rollouts: int = 0) -> dict:
    import aiohttp

    lat: list[float] = []
    errors = sent = 0
    vary = VARY in body
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def one(record: bool) -> None:
            nonlocal errors, sent
            sent += 1
            data = body.replace(VARY, str(sent).encode()) if vary else body
            target = url.replace(ROLLOUT, str(sent % rollouts)) if rollouts else url
            t0 = time.perf_counter()
            async with s.post(target, data=data, headers={"Content-Type": "application/json"}) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
            if record:
                lat.append(time.perf_counter() - t0)

        async def worker(count: int, record: bool) -> None:
            for _ in range(count):
                await one(record)

        await asyncio.gather(*(worker(max(1, warmup // concurrency), False) for _ in range(concurrency)))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(n // concurrency, True) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    lat.sort()
    return {"n": len(lat), "sent": sent, "errors": errors, "rps": len(lat) / wall, "p50_ms": 1000 * _q(lat, 0.5),
            "p99_ms": 1000 * _q(lat, 0.99), "mean_ms": 1000 * statistics.fmean(lat)}


def _q(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def loadgen_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--body", required=True, help="file with the JSON body")
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--requests", type=int, required=True)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--rollouts", type=int, default=0)
    a = p.parse_args(argv)
    import uvloop

    res = uvloop.run(_load(a.url, Path(a.body).read_bytes(), a.concurrency, a.requests, a.warmup, a.rollouts))
    print(json.dumps(res))


# ---------------------------------------------------------------------------------------------- driver

def _run_load(url: str, body: dict, concurrency: int, n: int, tmp: Path, pin: list[str], rollouts: int = 0) -> dict:
    f = tmp / f"body-{abs(hash(url)) % 10_000}.json"
    f.write_text(json.dumps(body))
    out = subprocess.run([*pin, sys.executable, "-m", "benchmarks.gateway_overhead", "loadgen", "--url", url,
                          "--body", str(f), "--concurrency", str(concurrency), "--requests", str(n),
                          "--rollouts", str(rollouts)],
                         capture_output=True, text=True, cwd=REPO, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _sqlite_spans(db: Path) -> int:
    import sqlite3

    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        return con.execute("SELECT count(*) FROM spans").fetchone()[0]


def _pg_spans(url: str) -> int:
    import psycopg

    with psycopg.connect(_pg_url(url, None)) as con:
        return con.execute("SELECT count(*) FROM spans").fetchone()[0]


def _stored_spans(count: Callable[[], int], expected: int, timeout: float = 60.0) -> int:
    """``count()`` (the spans in a store), polled until ``expected`` are there (recording is asynchronous)."""
    deadline, n = time.monotonic() + timeout, -1
    while time.monotonic() < deadline:
        n = count()
        if n >= expected:
            return n
        time.sleep(0.5)
    return n


def _pg_url(url: str, database: str | None) -> str:
    """``url`` (any PostgreSQL URL the store takes) as psycopg's, naming ``database`` instead (None: its own)."""
    from sqlalchemy import make_url

    u = make_url(url).set(drivername="postgresql")
    return (u if database is None else u.set(database=database)).render_as_string(hide_password=False)


def _pg_database(server: str, database: str, *, drop: bool = False) -> None:
    """Make (or drop) ``database`` on the PostgreSQL server of the URL ``server``."""
    import psycopg

    with psycopg.connect(_pg_url(server, None), autocommit=True) as con:
        con.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        if not drop:
            con.execute(f'CREATE DATABASE "{database}"')


def _tokenizer_dir(arg: str | None) -> Path:
    from tracegym.models import find_local_model_dir

    d = find_local_model_dir(arg or "tiny-random")
    if d is None:
        raise SystemExit("no tokenizer: run `tracegym models prepare tiny-random` or pass --tokenizer DIR")
    return d


def _bodies(op: str, model: str, distinct: bool) -> tuple[dict, str]:
    """The gateway request of ``op`` and its path (under ``/v1``); every chat-like op is the same call."""
    system, user = MESSAGES[0]["content"], MESSAGES[1]["content"]
    if distinct:
        user = f"Request {VARY.decode()}. {user}"
    if op == "completion":
        return {"model": model, "prompt": "2+3=", "max_tokens": 64}, "/completions"
    if op == "responses":
        return {"model": model, "instructions": system, "input": user, "max_output_tokens": 64}, "/responses"
    if op == "messages":
        return {"model": model, "system": system, "messages": [{"role": "user", "content": user}],
                "max_tokens": 64}, "/messages"
    messages = [MESSAGES[0], {"role": "user", "content": user}]
    return {"model": model, "messages": messages, "max_tokens": 64}, "/chat/completions"


def _point(procs: list, fport: int, gport: int, direct: dict, op: str, stream: bool, c: int, n: int, tmp: Path,
           pin: list[str], a: argparse.Namespace, model: str) -> tuple[dict, dict]:
    """One concurrency point of one op: the direct load, then the gateway's; prints both rows."""
    via, path = _bodies(op, model, a.distinct)
    path = f"/rollouts/bench-{ROLLOUT}/v1{path}" if a.rollouts else f"/v1{path}"
    if stream:
        via = {**via, "stream": True}
    cpu0 = _cpu_seconds(procs[0].proc.pid)
    d = _run_load(f"http://127.0.0.1:{fport}/generate", {**direct, "stream": stream}, c, n, tmp, pin)
    cpu1, gcpu0 = _cpu_seconds(procs[0].proc.pid), _cpu_seconds(procs[1].proc.pid)
    g = _run_load(f"http://127.0.0.1:{gport}{path}", via, c, n, tmp, pin, a.rollouts)
    gcpu1 = _cpu_seconds(procs[1].proc.pid)
    d["cpu_us"] = 1e6 * (cpu1 - cpu0) / (n + 200)  # the fake's CPU (warm-up included)
    g["cpu_us"] = 1e6 * (gcpu1 - gcpu0) / (n + 200)  # the gateway's own CPU
    label = f"{op}{' stream' if stream else ''}"
    for name, r in (("direct", d), ("gateway", g)):
        print(f"{label:18} {c:>3} {name:8} {r['rps']:>8.0f} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['errors']:>6}"
              f" {r['cpu_us']:>18.0f}")
    print(f"{label:18} {c:>3} added    p50 {g['p50_ms'] - d['p50_ms']:+.3f} ms, p99 {g['p99_ms'] - d['p99_ms']:+.3f} ms,"
          f" gateway/direct req/s = {g['rps'] / d['rps']:.2f}", flush=True)
    return d, g


Points = dict[int, list[tuple[dict, dict]]]  # concurrency → (direct, gateway) of each repeat


def _medians(points: Points) -> tuple[float, float, float]:
    """Median added p50 at c=1 (ms), gateway req/s at c=32, gateway CPU µs per request at c=32."""
    med = statistics.median
    return (med(g["p50_ms"] - d["p50_ms"] for d, g in points[1]), med(g["rps"] for _, g in points[32]),
            med(g["cpu_us"] for _, g in points[32]))


def _summary(results: dict[tuple[str, bool], Points]) -> None:
    """Each API against chat in the same mode, medians over the repeats: added p50 at c=1 (target ≤ 1.2×
    chat's) and gateway req/s at c=32 (target ≥ 0.8× chat's), and the gateway's CPU per request."""
    print("\nAPI vs chat (same mode, medians)  added p50 c=1 ms  ratio  req/s c=32  ratio  CPU us/req c=32  ratio")
    for (op, stream), points in results.items():
        chat = results.get(("chat", stream))
        if chat is None:
            continue
        (added, rps, cpu), (chat_added, chat_rps, chat_cpu) = _medians(points), _medians(chat)
        ratio = added / chat_added if chat_added > 0 else float("nan")
        print(f"{op + (' stream' if stream else ''):32} {added:>+16.3f} {ratio:>6.2f} {rps:>11.0f} "
              f"{rps / chat_rps:>6.2f} {cpu:>16.0f} {cpu / chat_cpu:>6.2f}")


def start_fake(tok_dir: Path, tmp: Path, pin: list[str]) -> tuple[ManagedProcess, int]:
    """The zero-latency SGLang fake (benchmarks/fake_sglang.py) on a free port: (its process, its port)."""
    port = free_port()
    return start_process([*pin, sys.executable, "-m", "benchmarks.fake_sglang", "--port", str(port), "--tokenizer",
                          str(tok_dir)], port=port, health_path="/health", log_path=tmp / f"fake-{port}.log",
                         cwd=REPO, timeout=120), port


def start_gateway(fport: int, tok_dir: Path, store: str, durability: str, tmp: Path, name: str,
                  pin: list[str]) -> tuple[ManagedProcess, int]:
    """``tracegym serve`` in front of the fake on ``fport``, recording into ``store`` with ``durability``, its
    log ``tmp/{name}.log``: (its process, its port)."""
    port = free_port()
    argv = [*pin, sys.executable, "-m", "tracegym.cli", "serve", "--port", str(port), "--upstream",
            f"http://127.0.0.1:{fport}", "--model", str(tok_dir), "--store", store, "--durability", durability,
            "--log-level", "warning"]
    return start_process(argv, port=port, health_path="/healthz", log_path=tmp / f"{name}.log", cwd=REPO,
                         timeout=120), port


def _durability_both(a: argparse.Namespace, tok_dir: Path, tmp: Path, pin: tuple[list[str], list[str]]) -> bool:
    """Commit-before-ack on and off, one gateway each, the same load alternated at each point."""
    from tracegym.gateway.proxy.prompt.templating import ChatTokenizer

    procs: list[ManagedProcess] = []
    modes = ("commit", "async")
    ports: dict[str, int] = {}
    dbs = {m: f"tg_bench_{m}_{os.getpid()}" for m in modes}
    stores = ({m: _pg_url(a.pg, dbs[m]) for m in modes} if a.pg
              else {m: f"sqlite:///{tmp / f'tg-{m}.db'}" for m in modes})
    try:
        fake, fport = start_fake(tok_dir, tmp, pin[1])
        procs.append(fake)
        for m in modes:
            if a.pg:
                _pg_database(a.pg, dbs[m])
            gw, ports[m] = start_gateway(fport, tok_dir, stores[m], m, tmp, f"gw-{m}", pin[0])
            procs.append(gw)
        tok = ChatTokenizer.from_dir(tok_dir)
        ids = tok.apply(MESSAGES)
        direct = {"input_ids": ids, "rid": "bench", "return_logprob": True, "stream": False,
                  "sampling_params": {"max_new_tokens": 64, "stop_token_ids": tok.eos_token_ids}}
        body, path = _bodies("chat", str(tok_dir), a.distinct)
        print(f"load average {Path('/proc/loadavg').read_text().split()[0]}; commit-before-ack on and off, chat, "
              f"{'PostgreSQL' if a.pg else 'SQLite'} store, {a.requests} requests per point, {a.repeat} rounds")
        print(f"{'durability':10} {'c':>3} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'errors':>6} "
              f"{'CPU us/req':>10}")
        added: dict[tuple[str, int], list[float]] = {}
        rps: dict[tuple[str, int], list[float]] = {}
        sent = dict.fromkeys(modes, 0)
        for _ in range(a.repeat):
            for c in (1, 32):
                n = a.requests if c > 1 else max(500, a.requests // 4)
                d = _run_load(f"http://127.0.0.1:{fport}/generate", direct, c, n, tmp, pin[1])
                for k, m in enumerate(modes):
                    cpu0 = _cpu_seconds(procs[1 + k].proc.pid)
                    g = _run_load(f"http://127.0.0.1:{ports[m]}/v1{path}", body, c, n, tmp, pin[1])
                    cpu = 1e6 * (_cpu_seconds(procs[1 + k].proc.pid) - cpu0) / (n + 200)  # the gateway's, all threads
                    sent[m] += g["sent"]
                    added.setdefault((m, c), []).append(g["p50_ms"] - d["p50_ms"])
                    rps.setdefault((m, c), []).append(g["rps"])
                    print(f"{m:10} {c:>3} {g['rps']:>8.0f} {g['p50_ms']:>8.3f} {g['p99_ms']:>8.3f} "
                          f"{g['p50_ms'] - d['p50_ms']:>+10.3f} {g['errors']:>6} {cpu:>10.0f}   (direct {d['rps']:.0f} req/s, "
                          f"p50 {d['p50_ms']:.3f} ms)", flush=True)
        med = statistics.median
        print("\nmedians   added p50 c=1 ms   req/s c=32")
        for m in modes:
            print(f"{m:10} {med(added[(m, 1)]):>+16.3f} {med(rps[(m, 32)]):>12.0f}")
        ok = True
        for m in modes:
            count = partial(_pg_spans, stores[m]) if a.pg else partial(_sqlite_spans, tmp / f"tg-{m}.db")
            stored = _stored_spans(count, sent[m])
            ok = ok and stored == sent[m]
            print(f"{m}: stored spans {stored} for {sent[m]} requests: {'OK' if stored == sent[m] else 'MISMATCH'}")
        return ok
    finally:
        for pr in procs:
            pr.stop()
        if a.pg:
            for m in modes:
                _pg_database(a.pg, dbs[m], drop=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "loadgen":
        loadgen_main(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--store", choices=["sqlite", "none"], default="sqlite")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--op", choices=["chat", "completion", "responses", "messages"], default="chat")
    p.add_argument("--stream", action="store_true", help="stream both sides")
    p.add_argument("--apis", action="store_true",
                   help="chat, responses and messages, non-stream and stream, with ratios to chat")
    p.add_argument("--repeat", type=int, default=3, help="with --apis: rounds of the rotation (medians)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the tiny-random cache)")
    p.add_argument("--distinct", action="store_true", help="a unique user message in every chat request")
    p.add_argument("--pin", action="store_true", help="gateway on CPU 0, fake and load generator on CPU 1")
    p.add_argument("--durability-both", action="store_true",
                   help="chat through two gateways, --durability commit and async, side by side")
    p.add_argument("--durability", choices=["commit", "async"], default="commit",
                   help="the gateway's --durability (commit: answered once the span is committed, the default)")
    p.add_argument("--pg", default=None, metavar="URL",
                   help="with --durability-both: record into databases made on this PostgreSQL server "
                        "(e.g. postgresql://127.0.0.1:5432/test) instead of SQLite files")
    p.add_argument("--rollouts", type=int, default=0, metavar="K",
                   help="chat calls sent to /rollouts/bench-{i %% K}/v1 (attributed calls: the per-rollout prefix "
                        "cache plans and remembers each one)")
    a = p.parse_args()
    if a.pg and not a.durability_both:
        p.error("--pg goes with --durability-both")
    if a.rollouts and a.op == "completion":
        p.error("--rollouts needs a chat-like --op")
    runs = ([(op, st) for st in (False, True) for _ in range(a.repeat) for op in ("chat", "responses", "messages")]
            if a.apis else [(a.op, a.stream)])
    pin_gw, pin_other = (["taskset", "-c", "0"], ["taskset", "-c", "1"]) if a.pin else ([], [])
    tok_dir = _tokenizer_dir(a.tokenizer)
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-"))
    if a.durability_both:
        try:
            ok = _durability_both(a, tok_dir, tmp, (pin_gw, pin_other))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if not ok:
            raise SystemExit(1)
        return
    store = f"sqlite:///{tmp / 'tg.db'}" if a.store == "sqlite" else "none"
    procs: list[ManagedProcess] = []
    try:
        fake, fport = start_fake(tok_dir, tmp, pin_other)
        procs.append(fake)
        gw, gport = start_gateway(fport, tok_dir, store, a.durability, tmp, "gw", pin_gw)
        procs.append(gw)
        from tracegym.gateway.proxy.prompt.templating import ChatTokenizer

        tok = ChatTokenizer.from_dir(tok_dir)
        ids = tok.encode("2+3=") if a.op == "completion" and not a.apis else tok.apply(MESSAGES)
        direct = {"input_ids": ids, "rid": "bench", "return_logprob": True, "stream": False,
                  "sampling_params": {"max_new_tokens": 64, "stop_token_ids": tok.eos_token_ids}}
        what = "chat, responses, messages (non-stream and stream)" if a.apis else (
            f"op={a.op}{' stream' if a.stream else ''}")
        print(f"load average {Path('/proc/loadavg').read_text().split()[0]} on {__import__('os').cpu_count()} cores; "
              f"gateway overhead, {what}, recording={'on (SQLite store)' if a.store == 'sqlite' else 'off'}"
              f"{f', durability {a.durability}' if a.store == 'sqlite' else ''}, "
              f"{a.requests} requests per point, prompt {len(ids)} tokens"
              f"{', distinct user messages' if a.distinct else ''}"
              f"{f', attributed to {a.rollouts} rollouts' if a.rollouts else ''}{', pinned (gateway CPU 0, others CPU 1)' if a.pin else ''}")
        print(f"{'api':18} {'c':>3} {'path':8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6} {'server CPU us/req':>18}")
        through = 0
        results: dict[tuple[str, bool], Points] = {}
        for op, stream in runs:
            for c in (1, 32):
                n = a.requests if c > 1 else max(500, a.requests // 4)
                d, g = _point(procs, fport, gport, direct, op, stream, c, n, tmp, pin_other, a, str(tok_dir))
                through += g["sent"]
                results.setdefault((op, stream), {}).setdefault(c, []).append((d, g))
        if a.apis:
            _summary(results)
        if a.store == "sqlite":
            stored = _stored_spans(partial(_sqlite_spans, tmp / "tg.db"), through)
            print(f"stored spans {stored} for {through} requests through the gateway (warm-up included): "
                  f"{'OK' if stored == through else 'MISMATCH'}")
            ok = stored == through
        else:
            ok = True
    finally:
        for pr in procs:
            pr.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
