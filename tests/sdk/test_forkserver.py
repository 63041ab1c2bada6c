"""``tracegym.forkserver``: children forked from a preloaded interpreter behave as ``subprocess.Popen``'s
``python -m`` children would (argv, environment, working directory, session, log, exit code, signals), and
``procs.spawn_process`` sends its ``python -m`` children there while ``$TRACEGYM_FORKSERVER`` names one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import fork_server, run_command
from tracegym import forkserver
from tracegym.procs import spawn_process

CHILD = [sys.executable, "-m", "tests.sdk.forked_child"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(forked_children: str | None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The session's fork server where it has one (``tests/conftest.py``), else one of this module's."""
    if forked_children is not None:
        yield forked_children
        return
    with fork_server(tmp_path_factory.mktemp("fs") / "server.log") as path:
        yield path


def test_a_child_gets_the_argv_environment_folder_session_and_log_it_asked_for(server: str, tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    env = {**os.environ, "FORKED_MARKER": "m1", "PYTHONPATH": str(ROOT)}
    child = forkserver.spawn(server, [*CHILD, "3", "x y"], env=env, cwd=tmp_path, log_path=log)
    assert child.wait(timeout=30) == 3
    assert child.poll() == 3 and child.returncode == 3
    text = log.read_text()
    assert f"argv=['3', 'x y'] cwd={tmp_path} marker=m1 main=__main__ sid=True stdin=''" in text
    assert "to stderr" in text
    assert "RuntimeWarning" not in text
    assert "routes=True frozen=True" in text  # preloaded, and its collections leave the server's objects alone


def test_signals_reach_the_child_and_its_exit_code_says_which(server: str, tmp_path: Path) -> None:
    child = forkserver.spawn(server, [*CHILD, "sleep"], env=dict(os.environ), cwd=ROOT, log_path=tmp_path / "c.log")
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    os.killpg(child.pid, signal.SIGKILL)  # its own process group, as procs.ManagedProcess.stop expects
    assert child.wait(timeout=30) == -signal.SIGKILL
    child.kill()  # a no-op once it has exited, as with Popen


def test_spawn_process_forks_while_a_server_is_named_and_starts_as_before_without_one(
        server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(forkserver.FORKSERVER_ENV, server)
    forked = spawn_process([*CHILD, "0"], port=None, log_path=tmp_path / "f.log", cwd=ROOT)
    assert isinstance(forked.proc, forkserver.ForkedChild) and forked.proc.wait(timeout=30) == 0
    popened = spawn_process(["tracegym", "--version"], port=None, log_path=tmp_path / "v.log")  # not `-m`
    assert isinstance(popened.proc, forkserver.ForkedChild)  # tracegym runs as `python -m tracegym.cli`
    assert popened.proc.wait(timeout=30) == 0 and (tmp_path / "v.log").read_text().strip()
    monkeypatch.setenv(forkserver.FORKSERVER_ENV, str(tmp_path / "gone"))
    fallback = spawn_process([*CHILD, "0"], port=None, log_path=tmp_path / "p.log", cwd=ROOT)
    assert isinstance(fallback.proc, subprocess.Popen) and fallback.proc.wait(timeout=60) == 0
    shell = spawn_process(["sh", "-c", "exit 4"], port=None, log_path=tmp_path / "s.log")
    assert isinstance(shell.proc, subprocess.Popen) and shell.proc.wait(timeout=30) == 4


def test_children_die_with_the_server(tmp_path: Path) -> None:
    with fork_server(tmp_path / "own.log") as path:
        child = forkserver.spawn(path, [*CHILD, "sleep"], env=dict(os.environ), cwd=ROOT, log_path=tmp_path / "c.log")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{child.pid}/stat").read_text().split()[2]
        except FileNotFoundError:
            break
        if state == "Z":  # exited, not reaped: its server is gone, so init reaps it
            break
        time.sleep(0.05)
    else:
        pytest.fail("the child outlived its fork server")


def test_a_request_it_cannot_serve_is_an_error(server: str) -> None:
    with pytest.raises(ValueError, match="runs only"):
        forkserver.spawn(server, ["sh", "-c", "true"], env={}, cwd=None, log_path=None)
    with pytest.raises(OSError, match="unknown request"):
        forkserver._ask(server, {"op": "nonsense"})
    with pytest.raises(OSError, match="ChildProcessError"):  # not one of its children: an answer, not a hang
        forkserver._ask(server, {"op": "wait", "pid": os.getpid()})


def test_run_command_forks_a_command_to_its_end_with_its_output_apart(
        server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {**os.environ, "FORKED_MARKER": "m2", "PYTHONPATH": str(ROOT)}
    monkeypatch.setenv(forkserver.FORKSERVER_ENV, server)
    res = run_command([*CHILD, "3"], cwd=tmp_path, env=env)
    assert res.returncode == 3 and res.stderr == "to stderr\n"
    assert f"argv=['3'] cwd={tmp_path} marker=m2" in res.stdout and "frozen=True" in res.stdout  # forked
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        run_command([*CHILD, "sleep"], cwd=ROOT, env=env, timeout=1)
    assert time.monotonic() - t0 < 30 and "argv=['sleep']" in str(timed_out.value.output)
    monkeypatch.delenv(forkserver.FORKSERVER_ENV)  # no server: subprocess.run, the same result
    fresh = run_command([*CHILD, "3"], cwd=tmp_path, env=env)
    assert fresh.returncode == 3 and fresh.stderr == "to stderr\n" and "frozen=False" in fresh.stdout
