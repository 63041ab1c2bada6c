"""The inference server's container in docker-compose.yml (cpu profile, tiny-random, no trainer run):

- the distributed weight push across containers: a trainer in a container of its own (``docker-compose
  run trainer``, with tests/e2e/container_push.py) sets up the weight-update group with the engine's
  container through the gateway's container and broadcasts every bucket over gloo on the compose network;
  the engine then serves the trainer's weights (its logprobs of a fixed prompt are the trainer's) under
  the pushed version, which the gateway reports too.
- an engine that never becomes healthy (a model name that does not exist: it exits and is restarted,
  again and again): `docker-compose up` stops once the gateway's wait for it is over
  (``TRACEGYM_UPSTREAM_WAIT``), naming the gateway's container as unhealthy; the gateway serves nothing and
  records nothing meanwhile, the trainer and the runner are not started, and once the engine is fixed the
  same gateway container comes up by itself and records calls."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.e2e.compose_support import ROOT, Stack, stack

pytestmark = pytest.mark.slow

PUSH = ROOT / "tests/e2e/container_push.py"
WAIT = 30
"""The gateway's wait for its inference server, in the never-healthy test (docker-compose.yml's default: 600)."""


def _psql(s: Stack, sql: str) -> str:
    return s.exec("postgres", "psql", "-U", "tracegym", "-d", "tracegym", "-At", "-c", sql).strip()


@pytest.mark.timeout(900)
def test_a_distributed_weight_push_from_a_trainer_container_reaches_the_engine_container() -> None:
    t0 = time.monotonic()
    with stack(["docker-compose.yml"], MODEL="tiny-random") as s:
        s.compose("up", "-d", "postgres", "engine", "gateway")
        s.wait("the gateway healthy, its engine reachable", s.gateway_ready, 300)
        up = time.monotonic()
        res = s.compose("run", "--rm", "-T", "--no-deps", "--entrypoint", "python", "trainer", "-",
                        input=PUSH.read_text(), check=False, timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + s.logs("engine", "gateway")
        got = json.loads(res.stdout.strip().splitlines()[-1])
        print({k: v for k, v in got.items() if k not in ("before", "after", "trainer", "ids", "ids_before")})
        print(f"stack up {up - t0:.0f} s, push container {time.monotonic() - up:.0f} s")

        engine_address = s.inspect("engine", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")
        assert got["trainer_address"] != engine_address and re.fullmatch(r"[\d.]+", got["trainer_address"])
        assert got["buckets"] > 2  # several buckets, each announced by the gateway and broadcast on cue
        assert got["version_before"] == "0" and got["result_version"] == "7"
        assert got["version_after"] == got["engine_model_version"] == "7"
        assert got["after"] != pytest.approx(got["before"], abs=1e-3)  # the weights did change
        assert got["after"] == pytest.approx(got["trainer"], abs=1e-4)  # into the trainer's
        weights = httpx.get(f"{s.url}/api/weights", headers=s.headers, timeout=30).json()
        assert weights["weight_version"] == "7"
        r = httpx.post(f"{s.url}/rollouts/after-push/v1/chat/completions", headers=s.headers, timeout=120,
                       json={"model": "tiny-random", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        assert _psql(s, "SELECT COUNT(*) FROM spans WHERE rollout_id = 'after-push'") == "1"


@pytest.mark.timeout(900)
def test_an_engine_that_never_becomes_healthy_stops_compose_up_within_the_wait() -> None:
    with stack(["docker-compose.yml"], MODEL="no-such-model", TRACEGYM_UPSTREAM_WAIT=str(WAIT)) as s:
        t0 = time.monotonic()
        res = s.compose("up", "-d", check=False, timeout=WAIT + 600)
        took = time.monotonic() - t0
        out = res.stdout + res.stderr
        print(f"docker-compose up -d: exit {res.returncode} after {took:.0f} s\n{out[-1500:]}")
        gateway = s.inspect("gateway", "{{.Id}}")
        assert res.returncode != 0
        assert f'Container "{gateway[:12]}" is unhealthy' in out
        assert took < WAIT + 120  # the wait, the healthcheck's three failures, the services' start
        assert s.inspect("gateway", "{{.State.Health.Status}}") == "unhealthy"
        assert s.inspect("gateway", "{{.State.Running}} {{.RestartCount}}") == "true 0"  # waiting, not looping
        assert "has not answered /health in" in s.logs("gateway")
        assert "no-such-model" in s.logs("engine")
        assert s.inspect("trainer", "{{.Id}}") == "" and s.inspect("runner", "{{.Id}}") == ""  # never started
        with pytest.raises(httpx.TransportError):  # nothing serves on the published port: nothing recorded
            httpx.post(f"{s.url}/v1/chat/completions", headers=s.headers, timeout=10,
                       json={"model": "x", "messages": [{"role": "user", "content": "hi"}]})
        assert _psql(s, "SELECT to_regclass('public.spans') IS NULL") == "t"  # no store was ever opened

        # the engine fixed: the same gateway container starts serving by itself
        s.env["MODEL"] = "tiny-random"
        s.compose("up", "-d", "engine")
        s.wait("the waiting gateway healthy once the engine answers", s.gateway_ready, 300)
        r = httpx.post(f"{s.url}/rollouts/late/v1/chat/completions", headers=s.headers, timeout=120,
                       json={"model": "tiny-random", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        assert s.inspect("gateway", "{{.RestartCount}}") == "0"
        assert _psql(s, "SELECT COUNT(*) FROM spans WHERE rollout_id = 'late'") == "1"
