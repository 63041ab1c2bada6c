"""``scripts/install.sh --print-torch``: which torch build the installer picks, per OS and per whether the
PyTorch CPU index answers (a local HTTP server stands in for it; a closed port for an unreachable one)."""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cpu_index(tmp_path: Path) -> Iterator[str]:
    """A local package index that has a ``torch/`` page."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "index.html").write_text("<a href='torch-2.13.0+cpu.whl'>torch</a>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def choose(**env: str) -> tuple[str, str]:
    """The two lines of ``install.sh --print-torch``: pip's arguments, and the message."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRACEGYM_TORCH")}
    res = subprocess.run(["bash", "scripts/install.sh", "--print-torch"], cwd=ROOT, env={**clean, **env},
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    args, message = res.stdout.splitlines()
    return args, message


def test_linux_takes_the_cpu_index_when_it_answers(cpu_index: str) -> None:
    args, message = choose(TRACEGYM_OS="Linux", TRACEGYM_TORCH_CPU_INDEX=cpu_index)
    assert args == f"torch==2.13.0 --index-url {cpu_index}"
    assert "the CPU build" in message and "TRACEGYM_TORCH=cuda" in message  # and how to get the GPU build


def test_linux_falls_back_to_the_configured_index_with_a_warning() -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    args, message = choose(TRACEGYM_OS="Linux", TRACEGYM_TORCH_CPU_INDEX=closed)
    assert args == "torch==2.13.0"
    assert f"CPU index ({closed}) did not answer" in message and "CUDA build" in message


def test_macos_takes_pypi_without_probing() -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    args, message = choose(TRACEGYM_OS="Darwin", TRACEGYM_TORCH_CPU_INDEX=closed)
    assert args == "torch==2.13.0" and "macOS" in message


def test_cuda_and_an_explicit_index_override_the_probe(cpu_index: str) -> None:
    args, message = choose(TRACEGYM_OS="Linux", TRACEGYM_TORCH_CPU_INDEX=cpu_index, TRACEGYM_TORCH="cuda")
    assert args == "torch==2.13.0" and "CUDA build" in message
    cu = "https://download.pytorch.org/whl/cu128"
    args, _ = choose(TRACEGYM_OS="Linux", TRACEGYM_TORCH_INDEX=cu)
    assert args == f"torch==2.13.0 --index-url {cu}"


def test_configured_takes_pips_index_without_probing(cpu_index: str) -> None:
    args, message = choose(TRACEGYM_OS="Linux", TRACEGYM_TORCH_CPU_INDEX=cpu_index, TRACEGYM_TORCH="configured")
    assert args == "torch==2.13.0" and "no probe" in message


def test_pyproject_lists_every_package() -> None:
    """setuptools cannot find packages through the remapped package-dir, so each is listed; a missing one
    is absent from a wheel (and setuptools warns at every install for a data-only folder left out)."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {v: k for k, v in setup["package-dir"].items()}
    found = set()
    for folder, name in roots.items():
        for d in [ROOT / folder, *(p for p in (ROOT / folder).rglob("*") if p.is_dir())]:
            if "__pycache__" not in d.parts and any(f.is_file() for f in d.iterdir()):
                rel = d.relative_to(ROOT / folder).parts
                found.add(".".join((name, *rel)))
    assert sorted(found) == sorted(setup["packages"])
