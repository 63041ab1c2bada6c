"""Running docker-compose.yml for real in the container tests: the images (scripts/docker_images.sh, once
per test process), one compose project per test with its own name, key and loopback port, and
`docker-compose down -v` after it (checked to leave no container, network or volume)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
_images: dict[str, str] = {}


def images() -> dict[str, str]:
    """Build (or find in Docker's cache) every image compose needs; the environment it needs for them."""
    if not _images:
        if shutil.which("docker-compose") is None or subprocess.run(["docker", "info"], capture_output=True).returncode:
            pytest.fail("the container tests need dockerd and docker-compose (.ci/run starts and installs them)")
        t0 = time.monotonic()
        res = subprocess.run(["bash", "scripts/docker_images.sh"], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "TRACEGYM_BASE": os.environ.get("TRACEGYM_BASE", "debian")})
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        print(f"scripts/docker_images.sh: {time.monotonic() - t0:.0f} s")
        _images.update(re.findall(r"^export (\w+)=(\S+)", res.stdout, re.M))
    return dict(_images)


class Stack:
    """One compose project: ``compose(...)`` runs docker-compose on it, ``url`` is the gateway."""

    def __init__(self, files: list[str], env: dict[str, str]) -> None:
        self.name = f"tgtest{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.key = uuid.uuid4().hex
        self.files = files
        self.env = {**os.environ, **images(), **env, "TRACEGYM_ADMIN_KEY": self.key,
                    "TRACEGYM_PORT": str(self.port), "HF_HUB_OFFLINE": "1"}
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {self.key}"}

    def compose(self, *args: str, check: bool = True, timeout: float = 600,
                input: str | None = None) -> subprocess.CompletedProcess:
        argv = ["docker-compose", "-p", self.name, *(a for f in self.files for a in ("-f", f)), "--profile", "cpu"]
        res = subprocess.run([*argv, *args], cwd=ROOT, env=self.env, capture_output=True, text=True,
                             timeout=timeout, input=input)
        if check:
            assert res.returncode == 0, f"docker-compose {' '.join(args)}: {res.stdout[-2000:]}{res.stderr[-2000:]}"
        return res

    def container(self, service: str) -> str:
        return f"{self.name}_{service}_1"

    def exec(self, service: str, *cmd: str, check: bool = True) -> str:
        res = subprocess.run(["docker", "exec", self.container(service), *cmd], capture_output=True, text=True,
                             timeout=120)
        if check:
            assert res.returncode == 0, f"{service}: {' '.join(cmd)}: {res.stderr[-2000:]}"
        return res.stdout

    def inspect(self, service: str, fmt: str) -> str:
        res = subprocess.run(["docker", "inspect", "-f", fmt, self.container(service)], capture_output=True,
                             text=True)
        return res.stdout.strip()

    def logs(self, *services: str, tail: int = 60) -> str:
        return self.compose("logs", "--no-color", f"--tail={tail}", *services, check=False).stdout

    def wait(self, what: str, ok: Callable[[], object], timeout: float, every: float = 2.0) -> object:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got = ok()
            except (httpx.HTTPError, OSError, ValueError):
                got = None
            if got:
                return got
            time.sleep(every)
        pytest.fail(f"{what}: not within {timeout:.0f} s\n{self.logs()}")

    def gateway_ready(self) -> bool:
        r = httpx.get(f"{self.url}/healthz", timeout=5)
        return r.status_code == 200 and r.json()["upstream"].get("reachable") is True

    def volume_sh(self, script: str) -> str:
        """Run ``sh -c script`` in a fresh container with the project's `weights` volume at /weights (the
        trainer's container may have exited)."""
        image = self.env.get("TRACEGYM_IMAGE", "tracegym:latest")
        res = subprocess.run(["docker", "run", "--rm", "-v", f"{self.name}_weights:/weights", "--entrypoint", "sh",
                              image, "-c", script], capture_output=True, text=True, timeout=120)
        return res.stdout

    def metrics(self, recipe_name: str) -> list[dict]:
        """metrics.jsonl of the recipe's latest run in the weights volume, one record a line."""
        out = self.volume_sh(f"cat /weights/{recipe_name}/latest/metrics.jsonl 2>/dev/null")
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def leftovers(self) -> list[str]:
        """Containers, networks and volumes of this project that docker still has."""
        found = []
        for kind, argv in (("container", ["docker", "ps", "-a", "--format", "{{.Names}}"]),
                           ("network", ["docker", "network", "ls", "--format", "{{.Name}}"]),
                           ("volume", ["docker", "volume", "ls", "--format", "{{.Name}}"])):
            out = subprocess.run(argv, capture_output=True, text=True).stdout.split()
            found += [f"{kind} {n}" for n in out if n.startswith(self.name + "_")]
        return found


@contextmanager
def stack(files: list[str], **env: str) -> Iterator[Stack]:
    s = Stack(files, env)
    try:
        yield s
    finally:
        print(s.logs("trainer", tail=40))
        s.compose("down", "-v", "--remove-orphans", "-t", "5", check=False)
        assert s.leftovers() == []
