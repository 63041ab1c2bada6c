"""The README and the docs/ pages: their generated parts match the code, and their commands run as
written. Every shell command in them (the ```bash blocks, and the README's examples table) is either run
here or named in ``EXPENSIVE`` with the reason and the test that covers it instead; those are still parsed
by the CLI's own parser, so a renamed flag fails here. Every ``python -m benchmarks.X ...`` names a
benchmark module and flags it defines; every relative link leads to a file that exists."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

from tests.procs import free_port, run_command, start_process
from tracegym.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
README = (ROOT / "README.md").read_text()
README_GATEWAY = "http://127.0.0.1:8000"

EXPENSIVE = {
    "bash scripts/install.sh": "installs every dependency (scripts/install.sh's torch choice: tests/test_install_script.py)",
    ". .venv/bin/activate": "the install line's second step",
    "tracegym train examples/quickstart/recipe.yaml": "trains SmolLM2 for minutes (tests/e2e/test_quickstart.py, slow)",
    "tracegym train examples/quickstart/recipe-lora.yaml": "trains SmolLM2's LoRA adapters for minutes (a "
    "tiny-random LoRA run through tracegym train: tests/e2e/test_lora_train.py, slow)",
    "tracegym train examples/tool_agent/recipe.yaml": "trains SmolLM2 for minutes (tests/e2e/test_tool_agent.py, "
    "slow)",
    "tracegym train examples/": "trains SmolLM2 for minutes (every example's recipe completes a step on tiny-random: "
    "tests/e2e/test_example_recipes.py, slow; one learns on SmolLM2: tests/e2e/test_example_learns.py, slow)",
    "bash .ci/run": "the whole test suite",
    "tracegym serve --upstream http://10.0.0.1:30000": "needs two SGLang engines on other hosts (a fleet: "
    "tests/gateway/proxy/upstream/test_fleet.py, tests/e2e/test_fleet_engines.py)",
    "tracegym serve --engine embedded --engines 2 --model smollm2-135m": "two SmolLM2 engines (two tiny-random "
    "ones under tracegym train: tests/trainer/run/test_services.py)",
    "tracegym inspect runs/quickstart": "needs a finished quickstart run (the same command on a run "
    "directory made by the test: tests/gateway/test_browse.py; the pages: tests/e2e/test_inspector_browser.py)",
    "tracegym serve --engine embedded --model smollm2-135m --store postgresql": "needs PostgreSQL and smollm2-135m",
    "createdb": "needs a PostgreSQL server (the store's tests run against one: tests/conftest.py pg_url)",
    "tracegym db upgrade --store postgresql": "needs a PostgreSQL server; its errors: tests/sdk/test_cli_errors.py",
    "bash scripts/docker_images.sh": "builds the images for minutes (run before the container tests by "
    "tests/e2e/compose_support.py and by .ci/run)",
    "export TRACEGYM_ADMIN_KEY": "sets the key compose needs (tests/test_compose.py: refused without it)",
    "export TRACEGYM_POSTGRES_IMAGE": "names the image scripts/docker_images.sh built (tests/e2e/compose_support.py)",
    "docker-compose": "needs Docker and trains for minutes (tests/e2e/test_compose_stack.py and "
    "tests/e2e/test_ray_containers.py, slow; tests/test_compose.py checks the files and their commands)",
    "kubectl apply -f deploy/kuberay/raycluster.yaml": "needs a Kubernetes cluster with KubeRay (the manifest: "
    "tests/test_compose.py)",
    "kubectl exec": "needs a Kubernetes cluster with KubeRay (joining a running Ray cluster: "
    "tests/e2e/test_train_ray.py, slow)",
    "tracegym tinker-serve --model smollm2-135m": "serves SmolLM2 until stopped (tiny-random's service: "
    "tests/trainer/service/conftest.py; SmolLM2's: tests/trainer/service/test_tinker_smollm2.py, slow)",
    "tracegym enqueue examples/": "the examples table: each framework example runs against tiny-random in "
    "tests/e2e/test_examples.py",
    "tracegym run examples/": "the examples table: each framework example runs against tiny-random in "
    "tests/e2e/test_examples.py",
}
"""Command prefix → why it is not run here. Every other command of the pages is run by a test below."""

CHEAP = ["tracegym --version", "tracegym models list", "tracegym models prepare tiny-random",
         "tracegym db upgrade --store sqlite:///tracegym.db", "tracegym db current --store sqlite:///tracegym.db"]
"""Run as written by ``test_cheap_commands_run_as_written``."""

HISTORY = re.compile(r"\bsessions? \d+|\bsession's\b|\bissues? #?\d+|\brounds? \d+ of the|\b(?=[0-9a-f]*\d)"
                     r"(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b|\bpredates\b|\bearlier rounds?\b")
"""What a page that describes the project as it is has no use for: sessions, issue numbers, commit hashes."""


@cache
def _text(page: str) -> str:
    return (ROOT / page).read_text()


def _bash_blocks(page: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", _text(page), flags=re.S)


def page_commands(page: str) -> list[list[str]]:
    """Every command of a page's ```bash blocks (and of the README's examples table), as argv lists
    (comments, line continuations and ``&&`` chains resolved)."""
    lines = []
    for block in _bash_blocks(page):
        lines += [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    if page == "README.md":
        lines += re.findall(r"^\| [^|]+ \| `(tracegym (?:enqueue|train) [^`]+)` \|$", README, flags=re.M)
    commands = []
    for line in lines:
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            commands.append(words[:cut])
            words = words[cut + 1 :]
    return [c for c in commands if c]


def all_commands() -> list[list[str]]:
    return [argv for page in PAGES for argv in page_commands(page)]


def _flow_block() -> list[list[str]]:
    """The README's four commands of "Point your agent at it" (serve, enqueue, run, export)."""
    block = next(block for block in _bash_blocks("README.md") if "tracegym export" in block)
    return [c for c in (shlex.split(line, comments=True) for line in block.splitlines()) if c]


def _run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    assert argv[0] == "tracegym", argv
    return run_command(argv, cwd=cwd, timeout=300, env={**os.environ, **env})


def test_recipe_reference_is_generated_from_the_config() -> None:
    res = subprocess.run([sys.executable, "scripts/gen_readme_reference.py", "--check"], cwd=ROOT)
    assert res.returncode == 0, "docs/recipe.md's table is stale: run python scripts/gen_readme_reference.py"


def test_readme_names_the_two_commands_and_stays_short() -> None:
    assert "tracegym train examples/quickstart/recipe.yaml" in README
    assert "bash .ci/run" in README
    assert (ROOT / "scripts/install.sh").is_file() and (ROOT / "scripts/test.sh").is_file()
    assert len(README.splitlines()) <= 400


@pytest.mark.parametrize("page", PAGES)
def test_every_command_is_run_or_listed_as_expensive(page: str) -> None:
    """The cheap commands are run below; the expensive ones parse (their flags exist) and name files that
    exist."""
    run_here = {*CHEAP, *(" ".join(c) for c in _flow_block())}
    for argv in page_commands(page):
        line = " ".join(argv)
        if line not in run_here and not any(line.startswith(p) for p in EXPENSIVE):
            pytest.fail(f"{page}: command neither run by tests/test_readme.py nor in EXPENSIVE: {line}")
        if argv[0] == "tracegym" and argv[1:] != ["--version"]:
            build_parser().parse_args(argv[1:])  # exits (fails the test) on an unknown flag or choice
            for word in argv[2:]:
                path = word.partition(":")[0] if ".py:" in word else word
                if path.startswith("examples/") and "runs/" not in path:
                    assert (ROOT / path).exists(), f"{page}: {line}: {path} does not exist"


def test_every_expensive_entry_is_used_and_names_real_tests() -> None:
    lines = [" ".join(argv) for argv in all_commands()]
    unused = {p for p in EXPENSIVE if not any(line.startswith(p) for line in lines)}
    assert not unused, f"EXPENSIVE entries no page's command uses: {unused}"
    named = {path for why in EXPENSIVE.values() for path in re.findall(r"tests/[\w/]+\.py", why)}
    assert not {p for p in named if not (ROOT / p).is_file()}, "EXPENSIVE names a test file that does not exist"


def _benchmark_flags(module: str) -> set[str]:
    tree = ast.parse((ROOT / "benchmarks" / f"{module}.py").read_text())
    return {arg.value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
            for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)}


@pytest.mark.parametrize("page", PAGES)
def test_benchmark_commands_name_real_modules_and_flags(page: str) -> None:
    for command in re.findall(r"`(python -m benchmarks\.[^`]+)`", _text(page)):
        argv = shlex.split(command)
        module = argv[2].removeprefix("benchmarks.")
        assert (ROOT / "benchmarks" / f"{module}.py").is_file(), f"{page}: {command}: no such benchmark"
        unknown = {w.partition("=")[0] for w in argv[3:] if w.startswith("--")} - _benchmark_flags(module)
        assert not unknown, f"{page}: {command}: benchmarks/{module}.py has no {unknown}"


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_lead_to_files(page: str) -> None:
    for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", _text(page)):
        if "://" not in target:
            assert ((ROOT / page).parent / target).exists(), f"{page}: link to {target}, which does not exist"


@pytest.mark.parametrize("page", PAGES)
def test_named_repository_paths_exist(page: str) -> None:
    """A file or folder of this repository named in backticks exists, so a page follows the code's moves."""
    named = re.findall(r"`((?:sdk|gateway|engine|modelfiles|trainer|examples|benchmarks|scripts|tests|docs)/[\w./-]*)`",
                       _text(page))
    missing = sorted({p for p in named if not (ROOT / p).exists()})
    assert not missing, f"{page} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES)
def test_pages_describe_the_project_not_its_history(page: str) -> None:
    found = [m.group(0) for m in HISTORY.finditer(_text(page))]
    assert not found, f"{page}: {found}"


def test_the_example_agents_exist() -> None:
    """Each ``tracegym run examples/...:agent`` names a function its file defines, and so does the agent
    target of each ``tracegym train examples/.../recipe.yaml`` (next to its recipe)."""
    commands = all_commands()
    targets = [w for argv in commands if argv[:2] == ["tracegym", "run"] for w in argv[2:3]]
    recipes = sorted({argv[2] for argv in commands if argv[:2] == ["tracegym", "train"] and len(argv) > 2})
    for recipe in [r for r in recipes if r.startswith("examples/")]:
        module, _, func = yaml.safe_load((ROOT / recipe).read_text())["agent"]["target"].partition(":")
        targets.append(f"{Path(recipe).parent / module}.py:{func}")
    assert len(targets) >= 9
    for target in targets:
        path, _, func = target.partition(":")
        tree = ast.parse((ROOT / path).read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        assert func in names, target


def test_cheap_commands_run_as_written(tmp_path: Path) -> None:
    for line in CHEAP:
        argv = shlex.split(line)
        assert argv in all_commands(), f"no page has: {line}"
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
    out = export[export.index("--out") + 1]
    assert len((tmp_path / out).read_text().splitlines()) > 0
    # run from a clone, the file lands where git does not see it
    ignored = subprocess.run(["git", "check-ignore", "-q", out], cwd=ROOT)
    assert ignored.returncode == 0, f"the README's export writes {out}, which git would show as untracked"
