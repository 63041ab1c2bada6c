"""Agent Lightning's gateway and tracegym's in front of one zero-latency upstream, side by side in one run.

    python -m benchmarks.peers [--rounds 3] [--duration 5] [--python PATH] [--no-async]

The upstream is ``benchmarks/fake_vllm.py`` (vLLM-shaped: ``/v1/chat/completions`` with
``return_token_ids`` and logprobs). Agent Lightning 1.0.2 (``agentlightning`` from PyPI, the version its
v1 gateway shipped in) runs as its users start it (``agl-server``, one uvicorn worker, its defaults) in a
Python 3.12 virtual environment this benchmark makes once under ``~/.cache/tracegym/peers/`` (``pip
install agentlightning==1.0.2``); the upstream is registered as its model and calls go to one rollout's
``/proxy/rollout/.../mode/train/openai/v1/chat/completions``. tracegym runs ``tracegym serve
--upstream-kind openai`` on a SQLite store, ``--durability commit`` (the default) and ``--durability
async``. Each round measures, in turn, the upstream called directly, Agent Lightning and tracegym: p50 at
c=1 and req/s and p99 at c=32 (wrk when it is installed, else this repository's aiohttp load generator).
Prints each point, then the medians (and the range) over the rounds: added p50 at c=1 over the direct
call, req/s and p99 at c=32, and tracegym's ratios to Agent Lightning and to the direct upstream.

Without Python 3.12 (``python3.12`` on PATH, pyenv's 3.12, or ``--python``) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tracegym.procs import ManagedProcess, free_port, start_process

REPO = Path(__file__).resolve().parents[1]
AGL_VERSION = "1.0.2"
VENV = Path.home() / ".cache" / "tracegym" / "peers" / f"agentlightning-{AGL_VERSION}"
MODEL = "fake-model"
TG_MODEL = "tiny-random"
"""The model tracegym serves (any name the fake accepts; its tokenizer gives the calls' token counts)."""
BODY = {"model": MODEL, "messages": [{"role": "system", "content": "You are a careful math tutor."},
                                     {"role": "user", "content": "What is 2+3? Answer with one short sentence."}],
        "max_tokens": 64}
WRK_LUA = """wrk.method = "POST"
local f = io.open("{body}", "r")
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"
"""


def find_python312(given: str | None) -> str | None:
    """A Python 3.12 interpreter that runs: ``given``, ``python3.12`` on PATH, pyenv's, the system's."""
    candidates = [given] if given else []
    if found := shutil.which("python3.12"):
        candidates.append(found)
    candidates += sorted(str(p) for p in (Path.home() / ".pyenv" / "versions").glob("3.12*/bin/python3.12"))
    candidates += ["/usr/bin/python3.12", "/usr/local/bin/python3.12"]
    for c in candidates:
        try:
            out = subprocess.run([c, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                                 text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == "(3, 12)":
            return c
    return None


def agl_venv(python: str) -> Path:
    """The virtualenv with agentlightning==1.0.2 (made and installed once)."""
    server = VENV / "bin" / "agl-server"
    if server.exists():
        return VENV
    print(f"making {VENV} with {python} and installing agentlightning=={AGL_VERSION} (once)", flush=True)
    VENV.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([python, "-m", "venv", str(VENV)], check=True)
    pip = subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", f"agentlightning=={AGL_VERSION}"],
                         capture_output=True, text=True)
    if pip.returncode != 0 or not server.exists():
        shutil.rmtree(VENV, ignore_errors=True)
        raise SystemExit(f"pip could not install agentlightning=={AGL_VERSION}:\n{pip.stdout[-2000:]}"
                         f"{pip.stderr[-2000:]}\n(it needs PyPI; rerun when it is reachable)")
    return VENV


def _post(url: str, body: object) -> None:
    import httpx

    r = httpx.post(url, json=body, timeout=30)
    r.raise_for_status()


def start_agl(venv: Path, upstream: str, tmp: Path) -> tuple[ManagedProcess, str]:
    """Agent Lightning's server with the upstream registered and one rollout; returns its proxy URL."""
    port = free_port()
    proc = start_process([str(venv / "bin" / "agl-server"), "host=127.0.0.1", f"port={port}",
                          f"default_proxy.model_name={MODEL}", f"hydra.run.dir={tmp / 'agl-hydra'}"],
                         port=port, health_path="/healthz", log_path=tmp / "agl.log", timeout=120, cwd=tmp)
    base = f"http://127.0.0.1:{port}"
    _post(f"{base}/api/models", [{"model": MODEL, "endpoint": f"{upstream}/v1"}])
    _post(f"{base}/api/rollouts", [{"input": {"q": "2+3"}, "rollout_id": "bench"}])
    return proc, f"{base}/proxy/rollout/bench/attempt/a1/mode/train/openai/v1/chat/completions"


def start_tracegym(upstream: str, tmp: Path, durability: str) -> tuple[ManagedProcess, str]:
    from tracegym.modelfiles.prepare import prepare_model

    prepare_model(TG_MODEL)  # its tokenizer and chat template: what the gateway serves under that name
    port = free_port()
    proc = start_process([sys.executable, "-m", "tracegym.cli", "serve", "--port", str(port), "--upstream-kind",
                          "openai", "--upstream", upstream, "--model", TG_MODEL,
                          "--store", f"sqlite:///{tmp / f'tg-{durability}.db'}", "--durability", durability,
                          "--log-level", "warning"], port=port, health_path="/healthz",
                         log_path=tmp / f"tg-{durability}.log", timeout=120, cwd=REPO)
    return proc, f"http://127.0.0.1:{port}/v1/chat/completions"


def _seconds(value: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", value)
    if not m:
        raise ValueError(f"unexpected wrk latency {value!r}")
    return float(m[1]) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}[m[2]]


def load(url: str, body: dict, concurrency: int, duration: float, tmp: Path) -> dict:
    """req/s, p50 and p99 (ms) and non-200 answers of ``concurrency`` clients for ``duration`` seconds."""
    f = tmp / "body.json"
    f.write_text(json.dumps(body))
    if shutil.which("wrk"):
        lua = tmp / "post.lua"
        lua.write_text(WRK_LUA.format(body=f))
        out = subprocess.run(["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(duration))}s", "-s", str(lua),
                              "--timeout", "60s", "--latency", url], capture_output=True, text=True, check=True).stdout
        pct = dict(re.findall(r"^\s+(50|99)%\s+(\S+)\s*$", out, re.M))
        errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
        return {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out)[1]),  # type: ignore[index]
                "p50_ms": 1e3 * _seconds(pct["50"]), "p99_ms": 1e3 * _seconds(pct["99"]),
                "errors": int(errors[1]) if errors else 0}
    n = max(200, int(duration * (300 if concurrency == 1 else 1500)))
    out = subprocess.run([sys.executable, "-m", "benchmarks.gateway_overhead", "loadgen", "--url", url, "--body",
                          str(f), "--concurrency", str(concurrency), "--requests", str(n)], capture_output=True,
                         text=True, cwd=REPO, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):,.2f} ({min(xs):,.2f}-{max(xs):,.2f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=5.0, help="seconds per point")
    p.add_argument("--python", default=None, help="a Python 3.12 interpreter for Agent Lightning's virtualenv")
    p.add_argument("--no-async", action="store_true", help="leave out tracegym --durability async")
    a = p.parse_args()
    python = find_python312(a.python)
    if python is None:
        print("skipped: Agent Lightning 1.0.2 needs Python 3.12, and none was found (python3.12 on PATH, "
              "~/.pyenv/versions/3.12*, /usr/bin/python3.12); install one or pass --python PATH")
        return 0
    venv = agl_venv(python)
    from benchmarks.machine import describe

    tmp = Path(tempfile.mkdtemp(prefix="tg-peers-"))
    procs: list[ManagedProcess] = []
    try:
        fport = free_port()
        procs.append(start_process([sys.executable, "-m", "benchmarks.fake_vllm", "--port", str(fport), "--model",
                                    MODEL], port=fport, health_path="/health", log_path=tmp / "fake.log",
                                   timeout=60, cwd=REPO))
        upstream = f"http://127.0.0.1:{fport}"
        sides: dict[str, str] = {"direct": f"{upstream}/v1/chat/completions"}
        agl, sides["agentlightning"] = start_agl(venv, upstream, tmp)
        procs.append(agl)
        for mode in ("commit",) if a.no_async else ("commit", "async"):
            tg, sides[f"tracegym {mode}"] = start_tracegym(upstream, tmp, mode)
            procs.append(tg)
        direct_body = {**BODY, "return_token_ids": True, "logprobs": True}
        print(describe(), f"(wrk: {'yes' if shutil.which('wrk') else 'no, aiohttp load generator'})", flush=True)
        print(f"{'side':22} {'round':>5} {'c':>3} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}")
        got: dict[tuple[str, int], list[dict]] = {}
        for r in range(1, a.rounds + 1):
            for c in (1, 32):
                for name, url in sides.items():
                    body = direct_body if name == "direct" else {**BODY, "model": TG_MODEL} if name.startswith(
                        "tracegym") else BODY
                    res = load(url, body, c, a.duration, tmp)
                    got.setdefault((name, c), []).append(res)
                    print(f"{name:22} {r:>5} {c:>3} {res['rps']:>9,.0f} {res['p50_ms']:>8.3f} {res['p99_ms']:>8.2f} "
                          f"{res['errors']:>6}", flush=True)
            print(f"  load average {os.getloadavg()[0]:.1f}", flush=True)
        print(f"\n{describe()}\nmedians (range) of {a.rounds} rounds")
        print(f"{'side':22} {'added p50 c=1 ms':>24} {'req/s c=32':>26} {'p99 c=32 ms':>24}")
        direct1 = [x["p50_ms"] for x in got[("direct", 1)]]
        for name in sides:
            added = [x["p50_ms"] - d for x, d in zip(got[(name, 1)], direct1, strict=True)]
            print(f"{name:22} {_med(added) if name != 'direct' else '-':>24} "
                  f"{_med([x['rps'] for x in got[(name, 32)]]):>26} {_med([x['p99_ms'] for x in got[(name, 32)]]):>24}")
        print("\ntracegym's ratios, per round (median, range)")
        for name in sides:
            if not name.startswith("tracegym"):
                continue
            tg32, agl32, d32 = got[(name, 32)], got[("agentlightning", 32)], got[("direct", 32)]
            rows = {"req/s c=32 / Agent Lightning's": [t["rps"] / g["rps"] for t, g in zip(tg32, agl32, strict=True)],
                    "req/s c=32 / direct upstream's": [t["rps"] / d["rps"] for t, d in zip(tg32, d32, strict=True)],
                    "p99 c=32 / direct upstream's": [t["p99_ms"] / d["p99_ms"] for t, d in zip(tg32, d32, strict=True)],
                    "added p50 c=1 / Agent Lightning's": [
                        (t["p50_ms"] - d["p50_ms"]) / (g["p50_ms"] - d["p50_ms"])
                        for t, g, d in zip(got[(name, 1)], got[("agentlightning", 1)], got[("direct", 1)], strict=True)
                        if g["p50_ms"] > d["p50_ms"]]}
            for label, xs in rows.items():
                print(f"  {name:18} {label:36} {_med(xs) if xs else '-'}")
        errors = sum(x["errors"] for xs in got.values() for x in xs)
        if errors:
            print(f"\n{errors} calls were not answered 200: the figures above are not comparable")
            return 1
        return 0
    finally:
        for pr in reversed(procs):
            pr.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
