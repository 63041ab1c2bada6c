"""Mistakes a user makes on the command line end in one or two lines on stderr (the problem, then the fix),
exit code 2 and no traceback; ``--debug`` adds the traceback. Each runs the real CLI as a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import free_port, pg_available, run_command

ROOT = Path(__file__).resolve().parents[2]


def tracegym(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRACEGYM_DEBUG": ""}
    return run_command(["tracegym", *args], cwd=cwd, env=env, timeout=120)


def assert_user_error(res: subprocess.CompletedProcess[str], *needles: str) -> list[str]:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and 1 <= len(lines) <= 2, res.stderr
    for needle in needles:
        assert needle in res.stderr, res.stderr
    return lines


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_serve_wrong_model_lists_the_known_names() -> None:
    res = tracegym("serve", "--engine", "embedded", "--model", "smollm-135m", "--port", str(free_port()))
    _, fix = assert_user_error(res, "unknown model 'smollm-135m'")
    assert "smollm2-135m" in fix and "tracegym models prepare" in fix


def test_models_prepare_wrong_name() -> None:
    assert_user_error(tracegym("models", "prepare", "no-such-model"), "unknown model 'no-such-model'", "tiny-random")


@pytest.mark.parametrize("args", [["engine", "--model", "smollm-135m"], ["models", "prepare", "smollm-135m"],
                                  ["serve", "--engine", "embedded", "--model", "smollm-135m"]])
def test_misspelt_model_is_reported_fast_before_torch(args: list[str]) -> None:
    """Checked before the command's implementation is imported: no torch, a "did you mean", within 5 s."""
    code = ("import sys\nfrom tracegym.cli import main\nrc = main(sys.argv[1:])\n"
            "assert 'torch' not in sys.modules\nsys.exit(rc)")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "TRACEGYM_DEBUG": ""})
    took = time.monotonic() - t0
    assert_user_error(res, "unknown model 'smollm-135m': did you mean 'smollm2-135m'?")
    assert took < 5, took


def test_misspelt_model_in_a_recipe_is_reported_fast_before_torch(tmp_path: Path) -> None:
    (tmp_path / "tasks.jsonl").write_text('{"input": 1}\n')
    (tmp_path / "recipe.yaml").write_text('name: t\nmodel: tiny_random\ndata: {path: tasks.jsonl}\n'
                                          'agent: {target: "agent:agent"}\n')
    code = ("import sys\nfrom tracegym.cli import main\nrc = main(sys.argv[1:])\n"
            "assert 'torch' not in sys.modules\nsys.exit(rc)")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code, "train", "recipe.yaml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRACEGYM_DEBUG": ""})
    assert_user_error(res, "unknown model 'tiny_random': did you mean 'tiny-random'?")
    assert time.monotonic() - t0 < 5


def test_did_you_mean() -> None:
    from tracegym.models import did_you_mean

    assert did_you_mean("SmolLM2-135M") == "smollm2-135m" and did_you_mean("tiny_random") == "tiny-random"
    assert did_you_mean("qwen3") == "qwen3-tiny" and did_you_mean("gpt-4o") is None


def test_serve_port_in_use(busy_port: int, tmp_path: Path) -> None:
    res = tracegym("serve", "--upstream", "http://127.0.0.1:9", "--port", str(busy_port),
                   "--store", f"sqlite:///{tmp_path / 'x.db'}")
    assert_user_error(res, f"port {busy_port} on 127.0.0.1 is already in use", "--port")


def test_unreachable_postgresql(tmp_path: Path) -> None:
    url = f"postgresql+psycopg://postgres:secret@127.0.0.1:{free_port()}/tracegym"
    for res in (tracegym("serve", "--upstream", "http://127.0.0.1:9", "--port", str(free_port()), "--store", url),
                tracegym("db", "upgrade", "--store", url)):
        assert "secret" not in res.stderr
        # serve warns first that a password on the command line shows in the process list
        warning = [line for line in res.stderr.splitlines() if "--store carries the store's password" in line]
        res.stderr = "".join(line + "\n" for line in res.stderr.splitlines() if line not in warning)
        assert_user_error(res, "cannot reach PostgreSQL at 127.0.0.1", "start PostgreSQL")


@pytest.mark.pg
def test_missing_postgresql_database_says_how_to_create_it() -> None:
    if not pg_available():
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432")
    url = "postgresql+psycopg://postgres@127.0.0.1:5432/tg_never_created"
    res = tracegym("db", "upgrade", "--store", url)
    assert_user_error(res, 'database "tg_never_created" does not exist', "createdb", "tracegym db upgrade")


def test_sqlite_store_in_a_missing_folder(tmp_path: Path) -> None:
    res = tracegym("db", "upgrade", "--store", f"sqlite:///{tmp_path / 'no' / 'such' / 'dir.db'}")
    assert_user_error(res, "cannot open the SQLite store", "must exist")


@pytest.mark.parametrize(
    ("target", "needle"),
    [
        ("no_such_module:agent", "no module named 'no_such_module'"),
        ("examples/nowhere.py:agent", "agent file not found"),
        ("tests/sdk/agents.py:no_such_function", "has no attribute 'no_such_function'"),
        ("agent_without_colon", "expected MODULE:FUNCTION"),
    ],
)
def test_run_bad_agent_target(target: str, needle: str) -> None:
    assert_user_error(tracegym("run", target, "--gateway", "http://127.0.0.1:9"), needle, "MODULE:FUNCTION")


def test_enqueue_missing_and_malformed_task_files(tmp_path: Path) -> None:
    gw = ["--gateway", f"http://127.0.0.1:{free_port()}"]
    assert_user_error(tracegym("enqueue", str(tmp_path / "nope.jsonl"), *gw), "task file not found", "JSONL")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": 1}\n{"input": 2,\n')
    assert_user_error(tracegym("enqueue", str(bad), *gw), f"{bad}:2: not valid JSON", "JSONL")
    bad.write_text('{"input": 1, "answer": 2}\n')
    assert_user_error(tracegym("enqueue", str(bad), *gw), "unknown task fields ['answer']")
    bad.write_text("\n")
    assert_user_error(tracegym("enqueue", str(bad), *gw), "no tasks")


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.jsonl")
    for args in (["--debug", "enqueue", missing], ["enqueue", missing, "--debug"]):
        res = tracegym(*args)
        assert res.returncode == 2 and "Traceback (most recent call last)" in res.stderr, res.stderr
        assert res.stderr.rstrip().endswith("e.g. {\"task_id\": \"t1\", \"input\": {\"question\": \"2+2?\"}}")


def test_run_against_no_gateway() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert_user_error(tracegym("run", "tests.sdk.agents:echo_reward", "--gateway", url),
                      f"no tracegym gateway answers at {url}", "tracegym serve")


def test_serve_upstream_unreachable_at_startup(tmp_path: Path) -> None:
    """Found inside the app's startup (uvicorn has logged its own start lines by then): the traceback is
    replaced by the two lines; --debug keeps it."""
    upstream = f"http://127.0.0.1:{free_port()}/v1"
    args = ["serve", "--upstream", upstream, "--upstream-kind", "openai", "--model", "not-local",
            "--port", str(free_port()), "--store", f"sqlite:///{tmp_path / 'x.db'}"]
    res = tracegym(*args)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    problem, fix = res.stderr.strip().splitlines()[-2:]
    assert problem.startswith(f"tracegym serve: the gateway cannot start: upstream {upstream}/models is unreachable")
    assert fix.startswith("start the inference server first")
    res = tracegym(*args, "--debug")
    assert res.returncode == 2 and "Traceback" in res.stderr and "UpstreamUnavailable" in res.stderr
