"""PostgreSQL restarting under load: ``tracegym serve`` on a PostgreSQL server of its own (``initdb`` +
``pg_ctl`` in a temporary directory, so the shared server of the other tests is left alone), clients
calling it without pause (OpenAI chat completions and Anthropic messages, each followed by a reward)
against the SGLang fake, and PostgreSQL stopped (``pg_ctl stop -m fast``: its sessions are ended), kept
down for a few seconds and started again while they call. Checked: every call answered 200 has its span
and every reward answered 201 is stored; a call or reward the store could not take is answered 503 in its
API's error shape (no 500, no other status) and none waits past a bound; the same gateway process
answers 200 again soon after PostgreSQL is back."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.procs import free_port, start_process
from tracegym.gateway.traces.reads import list_spans
from tracegym.gateway.traces.store import Store

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CLIENTS = 6
OUTAGE_S = 4.0
"""How long PostgreSQL stays down."""
ANSWER_BOUND_S = 20.0
"""No request may wait longer than this for its answer, outage or not."""
RECOVERY_BOUND_S = 15.0
"""After PostgreSQL is back, calls are answered 200 again within this."""


def _pg_bindir() -> Path:
    found = shutil.which("pg_config")
    if found:
        return Path(subprocess.run([found, "--bindir"], capture_output=True, text=True, check=True).stdout.strip())
    dirs = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name))
    if not dirs:
        pytest.fail("PostgreSQL's server programs (initdb, pg_ctl) are not installed")
    return dirs[-1]


@dataclass
class Postgres:
    """A PostgreSQL server in ``root`` on ``port`` (trust authentication on 127.0.0.1), run as the
    ``postgres`` user when this process is root (initdb refuses root)."""

    root: Path
    port: int
    bindir: Path = field(default_factory=_pg_bindir)

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: str) -> None:
        user = "postgres" if os.geteuid() == 0 else None
        subprocess.run([str(self.bindir / argv[0]), *argv[1:]], check=True, capture_output=True, timeout=120,
                       user=user)

    def init(self) -> None:
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self._run("initdb", "-D", str(self.root / "data"), "-U", "postgres", "-A", "trust", "--no-sync")

    def start(self) -> None:
        opts = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root}"
        self._run("pg_ctl", "-D", str(self.root / "data"), "-o", opts, "-l", str(self.root / "log"), "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.root / "data"), "-m", mode, "-w", "stop")

    def log(self) -> str:
        return (self.root / "log").read_text(errors="replace")[-3000:]


@contextmanager
def postgres() -> Iterator[Postgres]:
    root = Path(tempfile.mkdtemp(prefix="tracegym-pg-"))  # not under pytest's tmp: the postgres user reads it
    pg = Postgres(root, free_port())
    try:
        pg.init()
        pg.start()
        yield pg
    finally:
        subprocess.run([str(pg.bindir / "pg_ctl"), "-D", str(root / "data"), "-m", "immediate", "stop"],
                       capture_output=True, user="postgres" if os.geteuid() == 0 else None)
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Answer:
    kind: str  # "chat", "messages" or "reward"
    status: int  # 0: no answer (the connection failed)
    body: dict
    sent: float
    took: float


class Load:
    """``CLIENTS`` threads, each in a loop until ``stop``: a call in a fresh rollout (chat completions or
    Anthropic messages, alternately), then a reward for it; every answer is kept."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.lock = threading.Lock()
        self.answers: list[Answer] = []
        self.calls: dict[str, str] = {}  # call id -> rollout id, answered 200
        self.rewards: dict[str, str] = {}  # idempotency key -> rollout id, answered 201
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in self.threads:
            t.start()

    def _post(self, http: httpx.Client, kind: str, path: str, body: dict) -> Answer:
        t0 = time.monotonic()
        try:
            r = http.post(self.url + path, json=body)
            status, got = r.status_code, r.json()
        except (httpx.HTTPError, ValueError) as e:
            status, got = 0, {"exception": repr(e)}
        answer = Answer(kind, status, got, t0, time.monotonic() - t0)
        with self.lock:
            self.answers.append(answer)
        return answer

    def _client(self, i: int) -> None:
        with httpx.Client(timeout=ANSWER_BOUND_S * 3) as http:
            n = 0
            while not self.stop.is_set():
                rid = f"pg-{i}-{n}"
                msg = [{"role": "user", "content": f"What is {i}+{n}?"}]
                if n % 2:
                    a = self._post(http, "messages", f"/rollouts/{rid}/v1/messages",
                                   {"model": self.model, "max_tokens": 8, "messages": msg})
                else:
                    a = self._post(http, "chat", f"/rollouts/{rid}/v1/chat/completions",
                                   {"model": self.model, "max_tokens": 8, "messages": msg})
                if a.status == 200:
                    with self.lock:
                        self.calls[a.body["id"]] = rid
                    key = f"rw-{rid}"
                    r = self._post(http, "reward", f"/api/rollouts/{rid}/rewards",
                                   {"value": 1.0, "idempotency_key": key})
                    if r.status == 201:
                        with self.lock:
                            self.rewards[key] = rid
                n += 1

    def ok_since(self, t: float) -> int:
        with self.lock:
            return sum(a.status == 200 and a.sent >= t for a in self.answers)

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(ANSWER_BOUND_S * 3)


def _unavailable_shape(a: Answer) -> bool:
    """A 503 in the API's own error shape: Anthropic's for messages, OpenAI's for the rest."""
    if a.status != 503:
        return False
    if a.kind == "messages":
        return a.body.get("type") == "error" and a.body["error"]["type"] == "overloaded_error"
    return a.body.get("error", {}).get("type") == "server_error" and bool(a.body["error"].get("message"))


def _wait(what: str, ok, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if ok():
            return time.monotonic() - t0
        time.sleep(0.2)
    pytest.fail(f"{what}: not within {timeout:.0f} s")


@pytest.mark.timeout(600)
def test_postgres_restarting_under_load_loses_no_acknowledged_call(tiny_model_dir: Path, tmp_path: Path) -> None:
    with postgres() as pg:
        port = free_port()
        fake = start_process([sys.executable, "-m", "benchmarks.fake_sglang", "--port", str(port), "--tokenizer",
                              str(tiny_model_dir)], port=port, log_path=tmp_path / "fake.log", timeout=60,
                             env={"PYTHONPATH": str(REPO)})
        gw_port = free_port()
        argv = ["tracegym", "serve", "--port", str(gw_port), "--upstream", fake.base_url, "--model",
                str(tiny_model_dir), "--store", pg.url, "--log-level", "warning"]
        with fake, start_process(argv, port=gw_port, log_path=tmp_path / "gateway.log", health_path="/healthz",
                                 timeout=120) as gw:
            load = Load(gw.base_url, str(tiny_model_dir))
            try:
                _wait("calls answered before the restart", lambda: len(load.calls) >= 30, 60)
                down = time.monotonic()
                pg.stop()
                time.sleep(OUTAGE_S)
                pg.start()
                up = time.monotonic()
                recovered = _wait("a call answered 200 after PostgreSQL is back",
                                  lambda: load.ok_since(time.monotonic() - 0.5) > 0 and load.ok_since(up) > 0,
                                  RECOVERY_BOUND_S)
                _wait("more calls after the restart", lambda: load.ok_since(up) >= 30, 60)
            finally:
                load.join()
            gw_log = gw.log()
        assert gw.proc.returncode in (None, 0, -15), gw_log  # the same gateway process throughout

        answers = load.answers
        during = [a for a in answers if a.sent + a.took >= down and a.sent <= up]
        failed = [a for a in answers if a.status not in (200, 201)]
        slowest = max(a.took for a in answers)
        print(f"PostgreSQL down {up - down:.1f} s: {len(answers)} answers, {len(during)} during the outage, "
              f"{len(failed)} not 2xx ({sorted({(a.kind, a.status) for a in failed})}); slowest {slowest:.1f} s; "
              f"a call answered 200 {recovered:.1f} s after PostgreSQL was back; {len(load.calls)} calls and "
              f"{len(load.rewards)} rewards acknowledged")
        assert failed, "no request met the outage"  # the outage was seen
        bad = [(a.kind, a.status, a.body) for a in failed if not _unavailable_shape(a)]
        assert bad == [], bad[:5]
        assert slowest < ANSWER_BOUND_S

        store = Store.open(pg.url)
        try:
            stored = {rid: {s["call_id"] for s in list_spans(store, rid)} for rid in set(load.calls.values())}
            lost_calls = [c for c, rid in load.calls.items() if c not in stored[rid]]
            lost_rewards = [k for k, rid in load.rewards.items()
                            if k not in {e["idempotency_key"] for e in store.list_events(rid, "reward")}]
        finally:
            store.close()
        assert lost_calls == [] and lost_rewards == []
