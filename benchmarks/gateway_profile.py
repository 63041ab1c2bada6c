"""Where the gateway's CPU goes per recorded call: py-spy samples the gateway process (every thread, only
while it runs on a CPU) while the load generator of ``benchmarks.gateway_overhead`` sends calls (chat, or
the same call through ``--op responses|messages``; ``--stream``: streamed) at ``--concurrency`` (32) to a
zero-latency SGLang fake, recording on SQLite (``--pg URL``: on PostgreSQL), and the samples are grouped by
the stage they were in.

    python -m benchmarks.gateway_profile [--durability commit|async|both] [--requests 12000] [--rate 250]
                                         [--top 4] [--gil] [--stream] [--op chat|responses|messages]
                                         [--concurrency 32] [--pg URL]

A sample goes to the stage of the innermost project frame on its stack (``gateway/traces``: recording the
span, store included; ``gateway/proxy/prompt``: rendering and tokenizing the prompt; ``gateway/proxy/upstream``:
the hop to the engine; ``gateway/proxy`` else: the call path, reading the request and building the reply);
a stack with no project frame goes to the library it is in (the HTTP server, the ASGI framework, the event
loop). Each stage is printed as its share of the samples and as CPU µs per call (the share of the gateway's
CPU seconds over the load, from /proc, divided by the calls), with its innermost functions that took the
most samples (``--top``, each at least 0.5 %). ``--gil`` samples only the thread holding the GIL: the
gateway is one Python process, so that is the time its calls queue for. Needs ``py-spy`` (``pip install
py-spy``) and ``tracegym models prepare tiny-random``."""

from __future__ import annotations

import argparse
import collections
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.gateway_overhead import (
    _bodies,
    _cpu_seconds,
    _pg_database,
    _pg_url,
    _run_load,
    _tokenizer_dir,
    start_fake,
    start_gateway,
)
from benchmarks.machine import describe

PROJECT_STAGES = (  # path fragment of a project frame → stage, most specific first
    ("gateway/traces/", "recording the span (encode, queue, store, commit)"),
    ("gateway/proxy/prompt/", "prompt: render and tokenize, prefix plan"),
    ("gateway/proxy/upstream/", "upstream hop (request to the engine, its reply)"),
    ("gateway/proxy/", "call path: request, reply reading and building"),
    ("gateway/", "gateway other (app, middleware, API)"),
    ("sdk/", "tracegym package other"),
)
LOOP_AND_THREADS = (  # innermost frames of the event loop's own C work and of threads handing off
    ("asyncio/runners.py", "event loop (uvloop's own work: sockets, callbacks)"),
    ("asyncio/base_events.py", "event loop (uvloop's own work: sockets, callbacks)"),
    ("threading.py", "threads (waits, hand-offs)"),
    ("concurrent/futures/", "threads (waits, hand-offs)"),
)
LIBRARY_STAGES = (  # path fragment of a frame → stage, for stacks without a project frame
    ("uvicorn/", "HTTP server (uvicorn, httptools)"),
    ("httptools", "HTTP server (uvicorn, httptools)"),
    ("starlette/", "ASGI framework (Starlette, FastAPI)"),
    ("fastapi/", "ASGI framework (Starlette, FastAPI)"),
    ("sqlalchemy/", "store (SQLAlchemy, sqlite3) outside a project frame"),
    ("asyncio/", "event loop (uvloop's own work: sockets, callbacks)"),
    ("uvloop/", "event loop (uvloop's own work: sockets, callbacks)"),
)


def stage_of(frames: list[str]) -> str:
    """The stage of one sampled stack (``frames`` root first, each ``function (path:line)``)."""
    for frame in reversed(frames):
        path = frame.rpartition("(")[2]
        for fragment, stage in LOOP_AND_THREADS:
            if fragment in path:
                return stage
        if "site-packages" in path or "/lib/python" in path:
            continue
        for fragment, stage in PROJECT_STAGES:
            if fragment in path:
                return stage
    for frame in reversed(frames):
        for fragment, stage in LIBRARY_STAGES:
            if fragment in frame:
                return stage
    return "other"


def read_raw(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's ``--format raw`` output: one ``frame;frame;... count`` line per distinct stack."""
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def profile_mode(mode: str, fport: int, tok_dir: Path, tmp: Path, a: argparse.Namespace) -> None:
    """One gateway in ``mode``: warm up, then the load at ``--concurrency`` under py-spy; prints its stage
    table. ``--pg``: the gateway records on a database of its own on that server, dropped after."""
    database = f"tg_profile_{mode}_{uuid.uuid4().hex[:8]}"
    if a.pg:
        _pg_database(a.pg, database)
    store = _pg_url(a.pg, database) if a.pg else f"sqlite:///{tmp / f'tg-{mode}.db'}"
    gw, gport = start_gateway(fport, tok_dir, store, mode, tmp, f"gw-{mode}", [])
    try:
        body, path = _bodies(a.op, str(tok_dir), False)
        if a.stream:
            body = {**body, "stream": True}
        url = f"http://127.0.0.1:{gport}/v1{path}"
        _run_load(url, body, 32, 2000, tmp, [])  # warm-up: caches, connections, the store's first pages
        out = tmp / f"{mode}.raw"
        spy = subprocess.Popen(["py-spy", "record", "--pid", str(gw.proc.pid), "--rate", str(a.rate), "--format",
                                "raw", "--output", str(out), *a.spy_args],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            cpu0, t0 = _cpu_seconds(gw.proc.pid), time.monotonic()
            load = _run_load(url, body, a.concurrency, a.requests, tmp, [])  # as benchmarks.gateway_overhead
            cpu_us = 1e6 * (_cpu_seconds(gw.proc.pid) - cpu0) / (a.requests + 200)  # + its 200 warm-up calls
            seconds = time.monotonic() - t0
        finally:
            spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
            _, err = spy.communicate(timeout=60)
        if not out.exists():
            raise SystemExit(f"py-spy wrote no profile: {err.strip()[-500:]}")
        report(mode, read_raw(out), cpu_us, load, a, seconds)
    finally:
        gw.stop()
        if a.pg:
            _pg_database(a.pg, database, drop=True)


def report(mode: str, stacks: list[tuple[list[str], int]], cpu_us: float, load: dict, a: argparse.Namespace,
           seconds: float) -> None:
    """The stage table of one mode. Without ``--gil`` a stage's µs per call is its share of the gateway's CPU
    per call; with ``--gil`` the samples cover only the thread holding the GIL, and the table gives the share
    of the GIL's busy time and how busy it was (samples against the samples of a GIL held throughout)."""
    total = sum(n for _, n in stacks) or 1
    stages: collections.Counter[str] = collections.Counter()
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for frames, n in stacks:
        stage = stage_of(frames)
        stages[stage] += n
        leaves[stage][frames[-1]] += n
    streamed = " (streamed calls)" if a.stream else ""
    store = "PostgreSQL" if a.pg else "SQLite"
    print(f"\n--durability {mode}, {a.op}{streamed}, {store}: {load.get('rps', 0):.0f} req/s at "
          f"c={a.concurrency}, gateway CPU "
          f"{cpu_us:.0f} µs per call (all threads), {total} samples")
    if a.gil:
        print(f"GIL held in {100 * total / (a.rate * seconds):.0f} % of the samples py-spy meant to take "
              f"({a.rate}/s over {seconds:.1f} s)")
    print(f"{'stage':58} {'share':>6} {'' if a.gil else 'µs/call':>8}")
    for stage, n in stages.most_common():
        print(f"{stage:58} {100 * n / total:>5.1f}% {'' if a.gil else f'{cpu_us * n / total:.0f}':>8}")
        for leaf, k in leaves[stage].most_common(a.top):
            if k >= total / 200:  # functions under 0.5 % of the samples are left out
                print(f"    {100 * k / total:>5.1f}%  {leaf[:120]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--durability", choices=["commit", "async", "both"], default="both")
    p.add_argument("--requests", type=int, default=12000, help="calls sampled per mode")
    p.add_argument("--concurrency", type=int, default=32, help="clients sending at once")
    p.add_argument("--pg", default=None, metavar="URL",
                   help="record on PostgreSQL: a database of its own on this server (default: SQLite)")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--gil", action="store_true", help="sample only the thread holding the GIL (py-spy --gil)")
    p.add_argument("--top", type=int, default=4, help="innermost functions listed per stage")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the tiny-random cache)")
    p.add_argument("--stream", action="store_true", help="streamed calls (SSE), as `gateway_overhead --stream`")
    p.add_argument("--op", choices=("chat", "responses", "messages"), default="chat",
                   help="the API called: the same call through Chat Completions, Responses or Messages")
    a = p.parse_args()
    a.spy_args = ["--nonblocking", *(["--gil"] if a.gil else [])]
    if shutil.which("py-spy") is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    tok_dir = _tokenizer_dir(a.tokenizer)
    print(describe())
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        fake, fport = start_fake(tok_dir, tmp, [])
        try:
            for mode in (("commit", "async") if a.durability == "both" else (a.durability,)):
                profile_mode(mode, fport, tok_dir, tmp, a)
        finally:
            fake.stop()
    print(f"\n{describe()}")


if __name__ == "__main__":
    main()
