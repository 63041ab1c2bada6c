"""`docker-compose --profile cpu up` for real (docker-compose.yml, the images of scripts/docker_images.sh):
PostgreSQL, the embedded engine (as `sglang`), the gateway, the trainer and the runner in containers train
SmolLM2 on the quickstart (recipe-compose-short.yaml: 4 steps, a checkpoint after each) through the
gateway's published loopback port, with two faults on the way:

- the gateway's process killed with SIGKILL under agent load (this test's clients, besides the runner's),
  after the trainer's first checkpoint: the restart policy brings the container back, every call answered
  200 has its span in PostgreSQL and every reward answered 201 is stored. (The kill comes from the host,
  as from the OOM killer or a crash: Docker 20.10 takes `docker kill` for a manual stop, to which no
  restart policy applies; `docker-compose up -d` starts such a container again, as below.)
- `docker kill -s KILL` of the trainer container, then `docker-compose up -d`: it continues from its
  checkpoint (tracegym-train-or-resume), every step is trained, no group is queued twice and no rollout
  completed before the kill runs again.

Then the run's held-out evaluations before and after, and `docker-compose down -v` leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.e2e.compose_support import ROOT, Stack, images, stack

pytestmark = pytest.mark.slow

RECIPE = "examples/quickstart/recipe-compose-short.yaml"
NAME, STEPS, BATCH, GROUP = "compose-short", 4, 8, 4
CLIENTS, KILL_AFTER = 6, 24


class Load:
    """``CLIENTS`` threads, each a loop of one call in a fresh rollout and a reward for it, until the gateway
    is gone; what was acknowledged is kept."""

    def __init__(self, s: Stack) -> None:
        self.s = s
        self.lock = threading.Lock()
        self.calls: dict[str, str] = {}  # call id -> rollout id, answered 200
        self.rewards: dict[str, str] = {}  # idempotency key -> rollout id, answered 201
        self.enough = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        with httpx.Client(timeout=120, headers=self.s.headers) as http:
            for n in range(10_000):
                rid = f"load-{i}-{n}"
                body = {"model": "smollm2-135m", "max_tokens": 8,
                        "messages": [{"role": "user", "content": f"What is {i}+{n}?"}]}
                try:
                    r = http.post(f"{self.s.url}/rollouts/{rid}/v1/chat/completions", json=body)
                    if r.status_code != 200:
                        return
                    with self.lock:
                        self.calls[r.json()["id"]] = rid
                        if len(self.calls) >= KILL_AFTER:
                            self.enough.set()
                    key = f"rw-{rid}"
                    r = http.post(f"{self.s.url}/api/rollouts/{rid}/rewards", json={"value": 1.0, "idempotency_key": key})
                    if r.status_code != 201:
                        return
                    with self.lock:
                        self.rewards[key] = rid
                except httpx.HTTPError:  # the gateway is gone
                    return

    def join(self) -> None:
        for t in self.threads:
            t.join(120)


def _lost(s: Stack, load: Load) -> tuple[list[str], list[str]]:
    lost_calls, lost_rewards = [], []
    with httpx.Client(timeout=60, headers=s.headers) as http:
        for rid in sorted(set(load.calls.values())):
            r = http.get(f"{s.url}/api/rollouts/{rid}/spans")
            assert r.status_code == 200, r.text
            body = r.json()
            spans = body["spans"] if isinstance(body, dict) else body
            stored = {sp["call_id"] for sp in spans}
            lost_calls += [c for c, x in load.calls.items() if x == rid and c not in stored]
        for key, rid in load.rewards.items():
            r = http.get(f"{s.url}/api/rollouts/{rid}")
            events = r.json().get("rewards", []) if r.status_code == 200 else []
            if key not in {e.get("idempotency_key") for e in events}:
                lost_rewards.append(key)
    return lost_calls, lost_rewards


def _psql(s: Stack, sql: str) -> list[list[str]]:
    out = s.exec("postgres", "psql", "-U", "tracegym", "-d", "tracegym", "-At", "-F", "\t", "-c", sql)
    return [line.split("\t") for line in out.splitlines() if line]


def _completed(s: Stack) -> dict[str, tuple[str, ...]]:
    """Completed training rollouts: id -> (group, attempt, finished_at, spans)."""
    rows = _psql(s, "SELECT r.rollout_id, r.group_id, r.attempt, r.finished_at, "
                    "(SELECT COUNT(*) FROM spans x WHERE x.rollout_id = r.rollout_id) FROM rollouts r "
                    "WHERE r.status = 'completed' AND r.group_id LIKE '%-train-%'")
    return {r[0]: tuple(r[1:]) for r in rows}


def _crash(s: Stack, service: str) -> int:
    """SIGKILL to the container's main process from the host; its restart count before."""
    restarts = int(s.inspect(service, "{{.RestartCount}}"))
    os.kill(int(s.inspect(service, "{{.State.Pid}}")), signal.SIGKILL)
    return restarts


def _restarted(s: Stack, service: str, restarts: int) -> bool:
    return int(s.inspect(service, "{{.RestartCount}}")) > restarts and s.inspect(service, "{{.State.Running}}") == "true"


def _trained(s: Stack) -> list[int]:
    return [m["step"] for m in s.metrics(NAME) if m.get("kind") == "train"]


@pytest.mark.timeout(1800)  # SmolLM2 in five containers on a shared 2-core machine
def test_compose_cpu_profile_trains_through_a_gateway_and_a_trainer_kill() -> None:
    t0 = time.monotonic()
    with stack(["docker-compose.yml"], TRACEGYM_RECIPE=RECIPE) as s:
        s.compose("up", "-d")
        s.wait("the gateway healthy, its engine reachable", s.gateway_ready, 300)
        print(f"stack up: {time.monotonic() - t0:.0f} s")
        ui = httpx.get(f"{s.url}/ui", headers=s.headers, timeout=30, follow_redirects=True)
        assert ui.status_code == 200 and "<html" in ui.text.lower()  # the trace inspector, on the published port
        assert httpx.get(f"{s.url}/api/rollouts", timeout=30).status_code == 401  # the admin key is needed

        s.wait("the first step trained and checkpointed", lambda: _trained(s), 900, every=5)

        # 1. the gateway, killed under load
        load = Load(s)
        assert load.enough.wait(300), "the load never got going\n" + s.logs("gateway")
        restarts = _crash(s, "gateway")
        load.join()
        s.wait("the gateway restarted by its restart policy", lambda: _restarted(s, "gateway", restarts), 120)
        s.wait("the restarted gateway healthy", s.gateway_ready, 300)
        lost_calls, lost_rewards = _lost(s, load)
        print(f"gateway kill: {len(load.calls)} calls and {len(load.rewards)} rewards acknowledged, "
              f"lost {len(lost_calls)} calls, {len(lost_rewards)} rewards")
        assert len(load.calls) >= KILL_AFTER and lost_calls == [] and lost_rewards == []

        # 2. the trainer, killed after a checkpoint and started again
        done = len(_trained(s))
        s.wait("one more training step", lambda: len(_trained(s)) > done, 900, every=5)
        before = _completed(s)
        subprocess.run(["docker", "kill", "-s", "KILL", s.container("trainer")], check=True, capture_output=True)
        s.compose("up", "-d")
        s.wait("the trainer's run finished", lambda: s.inspect("trainer", "{{.State.Status}}") == "exited", 1200,
               every=5)
        assert s.inspect("trainer", "{{.State.ExitCode}}") == "0", s.logs("trainer", tail=200)
        log = s.logs("trainer", tail=5000)
        assert "tracegym-train-or-resume: resuming /weights/compose-short/" in log

        rows = s.metrics(NAME)
        train = [m for m in rows if m["kind"] == "train"]
        assert sorted({m["step"] for m in train}) == list(range(1, STEPS + 1))
        groups = _psql(s, "SELECT group_id, COUNT(*) FROM rollouts WHERE group_id LIKE '%-train-%' GROUP BY group_id")
        assert len(groups) == STEPS * BATCH and all(n == str(GROUP) for _, n in groups), groups  # none twice
        after = _completed(s)
        for rid, v in before.items():  # not lost, not run again
            assert after[rid] == v, rid
        evals = {m["step"]: m["reward_mean"] for m in rows if m["kind"] == "eval"}
        print(f"held-out reward: step 0 {evals.get(0)} -> step {STEPS} {evals.get(STEPS)}; "
              f"wall time {time.monotonic() - t0:.0f} s")
        assert set(evals) == {0, STEPS}
        (last,) = s.volume_sh("ls /weights/compose-short/latest/weights").split()  # the last swap's weights
        trained = {m["step"] for m in train if "loss" in m}  # a step whose groups all tie trains nothing
        assert last.startswith("v") and int(last[1:]) >= len(trained) >= 1


def test_a_base_image_that_cannot_be_built_is_named_with_what_to_do() -> None:
    """Debian's packages from a mirror that does not answer: the script stops at debootstrap, says so and
    what to do, and the base image it had is kept."""
    images()
    env = {**os.environ, "TRACEGYM_BASE": "debian", "TRACEGYM_REBUILD_BASE": "1",
           "DEBIAN_MIRROR": "http://127.0.0.1:9/debian"}
    res = subprocess.run(["bash", "scripts/docker_images.sh"], cwd=ROOT, capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode != 0
    assert 'step "tracegym/debian-python:bookworm: debootstrap bookworm from http://127.0.0.1:9/debian" failed' \
        in res.stderr
    assert "set DEBIAN_MIRROR=URL" in res.stderr
    assert subprocess.run(["docker", "image", "inspect", "tracegym/debian-python:bookworm"],
                          capture_output=True).returncode == 0
