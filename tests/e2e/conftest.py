"""One `tracegym serve --engine embedded --model tiny-random` (gateway + engine child + SQLite store) for
every e2e module that does not change the engine's weights; a module that does (test_swap) overrides
``gateway`` with its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import ManagedProcess, free_port, start_process


def serve_tiny(tmp: Path, *extra: str) -> ManagedProcess:
    """A gateway with the embedded engine on tiny-random and a SQLite store in ``tmp``."""
    port = free_port()
    argv = ["tracegym", "serve", "--engine", "embedded", "--model", "tiny-random", "--port", str(port),
            "--store", f"sqlite:///{tmp / 'tracegym.db'}", *extra]  # fmt: skip
    return start_process(argv, port=port, log_path=tmp / "gateway.log", health_path="/healthz", timeout=240)


@pytest.fixture(scope="session")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    # a small body limit so the 413 case is cheap to provoke (test_openai_client)
    with serve_tiny(tmp_path_factory.mktemp("e2e-gateway"), "--max-body-bytes", "200000") as gw:
        yield gw
