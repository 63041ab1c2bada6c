"""The README's generated parts match the code, and its commands run as written: every shell command in it
(its ```bash blocks and the examples table) is either run here or named in ``EXPENSIVE`` with the reason
and the test that covers it instead; those are still parsed by the CLI's own parser, so a renamed flag
fails here."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import free_port, start_process
from tracegym.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
README_GATEWAY = "http://127.0.0.1:8000"

EXPENSIVE = {
    "bash scripts/install.sh": "installs every dependency (scripts/install.sh's torch choice: tests/test_install_script.py)",
    ". .venv/bin/activate": "the install line's second step",
    "tracegym train examples/quickstart/recipe.yaml": "trains SmolLM2 for minutes (tests/e2e/test_quickstart.py, slow)",
    "tracegym train examples/tool_agent/recipe.yaml": "trains SmolLM2 for minutes (tests/e2e/test_tool_agent.py, "
    "slow)",
    "bash .ci/run": "the whole test suite",
    "tracegym serve --upstream http://10.0.0.1:30000": "needs two SGLang engines on other hosts (a fleet: "
    "tests/gateway/proxy/upstream/test_fleet.py, tests/e2e/test_fleet_engines.py)",
    "tracegym serve --engine embedded --engines 2 --model smollm2-135m": "two SmolLM2 engines (two tiny-random "
    "ones under tracegym train: tests/trainer/test_processes.py)",
    "tracegym serve --store sqlite:///runs/quickstart/latest/tracegym.db": "needs a finished "
    "quickstart run and smollm2-135m prepared (the inspector: tests/e2e/test_inspector_browser.py)",
    "tracegym serve --engine embedded --model smollm2-135m --store postgresql": "needs PostgreSQL and smollm2-135m",
    "createdb": "needs a PostgreSQL server (the store's tests run against one: tests/conftest.py pg_url)",
    "tracegym db upgrade --store postgresql": "needs a PostgreSQL server; its errors: tests/sdk/test_cli_errors.py",
    "docker compose": "needs Docker (tests/test_compose.py checks the file and its commands)",
    "kubectl exec": "needs a Kubernetes cluster with KubeRay (joining a running Ray cluster: "
    "tests/e2e/test_train_ray.py, slow)",
    "tracegym enqueue examples/": "the examples table: each framework example runs against tiny-random in "
    "tests/e2e/test_examples.py",
    "tracegym run examples/": "the examples table: each framework example runs against tiny-random in "
    "tests/e2e/test_examples.py",
}
"""Command prefix → why it is not run here. Everything else in the README is run by a test below."""


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def readme_commands() -> list[list[str]]:
    """Every command of the README's ```bash blocks and its examples table, as argv lists (comments,
    line continuations and ``&&`` chains resolved)."""
    lines = []
    for block in _bash_blocks():
        lines += [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    lines += re.findall(r"^\| [^|]+ \| `(tracegym (?:enqueue|train) [^`]+)` \|$", README, flags=re.M)
    commands = []
    for line in lines:
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            commands.append(words[:cut])
            words = words[cut + 1 :]
    return [c for c in commands if c]


CHEAP = ["tracegym --version", "tracegym models list", "tracegym models prepare tiny-random",
         "tracegym db upgrade --store sqlite:///tracegym.db", "tracegym db current --store sqlite:///tracegym.db"]
"""Run as written by ``test_cheap_commands_run_as_written``."""


def _flow_block() -> list[list[str]]:
    """The four commands of "Point your agent at it" (serve, enqueue, run, export)."""
    block = next(block for block in _bash_blocks() if "tracegym export" in block)
    return [c for c in (shlex.split(line, comments=True) for line in block.splitlines()) if c]


def _run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    assert argv[0] == "tracegym", argv
    return subprocess.run([sys.executable, "-m", "tracegym.cli", *argv[1:]], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})


def test_recipe_reference_is_generated_from_the_config() -> None:
    res = subprocess.run([sys.executable, "scripts/gen_readme_reference.py", "--check"], cwd=ROOT)
    assert res.returncode == 0, "README recipe table is stale: run python scripts/gen_readme_reference.py"


def test_readme_names_the_two_commands() -> None:
    assert "tracegym train examples/quickstart/recipe.yaml" in README
    assert "bash .ci/run" in README
    assert (ROOT / "scripts/install.sh").is_file() and (ROOT / "scripts/test.sh").is_file()


def test_every_command_is_run_or_listed_as_expensive() -> None:
    """The cheap commands below are the README's own; the expensive ones parse (their flags exist) and
    name files that exist."""
    run_here = {*CHEAP, *(" ".join(c) for c in _flow_block())}
    seen_expensive = set()
    for argv in readme_commands():
        line = " ".join(argv)
        if line not in run_here:
            prefix = next((p for p in EXPENSIVE if line.startswith(p)), None)
            if prefix is None:
                pytest.fail(f"README command neither run by tests/test_readme.py nor in EXPENSIVE: {line}")
            seen_expensive.add(prefix)
        if argv[0] == "tracegym" and argv[1:] != ["--version"]:
            build_parser().parse_args(argv[1:])  # exits (fails the test) on an unknown flag or choice
            for word in argv[2:]:
                path = word.partition(":")[0] if ".py:" in word else word
                if path.startswith("examples/") and "runs/" not in path:
                    assert (ROOT / path).exists(), f"{line}: {path} does not exist"
    assert seen_expensive == set(EXPENSIVE), f"EXPENSIVE entries no README command uses: {set(EXPENSIVE) - seen_expensive}"


def test_the_example_agents_exist() -> None:
    """Each ``tracegym run examples/...:agent`` in the README names a function its file defines."""
    targets = [w for argv in readme_commands() if argv[:2] == ["tracegym", "run"] for w in argv[2:3]]
    assert len(targets) >= 6
    for target in targets:
        path, _, func = target.partition(":")
        tree = ast.parse((ROOT / path).read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        assert func in names, target


def test_cheap_commands_run_as_written(tmp_path: Path) -> None:
    for line in CHEAP:
        argv = shlex.split(line)
        assert argv in readme_commands(), f"the README no longer has: {line}"
        res = _run(argv, tmp_path)
        assert res.returncode == 0, f"{line}\n{res.stderr}"
        assert "Traceback" not in res.stderr, res.stderr
    assert (tmp_path / "tracegym.db").is_file()
    assert "tiny-random" in _run(["tracegym", "models", "list"], tmp_path).stdout


def test_serve_enqueue_run_export_as_written(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The README's four commands of "Point your agent at it", on tiny-random and a free port instead of
    smollm2-135m on :8000 (the agent's replies are garbage; the commands are what is tested)."""
    serve, enqueue, run, export = _flow_block()
    assert serve[:2] == ["tracegym", "serve"] and "--port" not in serve
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [("tiny-random" if w == "smollm2-135m" else w) for w in serve]
    serve += ["--port", str(port), "--store", f"sqlite:///{tmp_path / 'tracegym.db'}"]
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {"TRACEGYM_MODEL": "tiny-random", "TRACEGYM_MAX_TOKENS": "8"}
    with start_process(serve, port=port, log_path=tmp_path / "serve.log", health_path="/healthz", timeout=240):
        outs = []
        for argv in (enqueue, run, export):
            res = _run([url if w == README_GATEWAY else w for w in argv], tmp_path, **env)
            assert res.returncode == 0, f"{argv}\n{res.stderr[-3000:]}"
            outs.append(res)
    assert "enqueued 3 tasks, 12 rollouts" in outs[0].stdout
    assert "queue drained: 12 rollouts done" in outs[1].stderr, outs[1].stderr[-2000:]
    assert len((tmp_path / "sft.jsonl").read_text().splitlines()) > 0
