"""Every ```python block of README.md and docs/*.md runs as written: each is run as its own script against
a gateway started here, with the embedded engine on tiny-random served under the name the pages use
(``smollm2-135m``: the test's model cache holds tiny-random under that name, so the blocks keep their model
names). The only change made to a block is the gateway's address, the pages' ``http://127.0.0.1:8000``
replaced by the test gateway's. A block that cannot run here is named in ``NOT_RUN`` with the reason."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.procs import free_port, start_process

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
PAGE_GATEWAY = "http://127.0.0.1:8000"
PAGE_MODEL = "smollm2-135m"

NOT_RUN: dict[str, str] = {
    "service = tinker.ServiceClient(": "talks to tracegym tinker-serve, not the gateway: it runs as written against "
    "the service in tests/trainer/service/test_tinker_sdk.py (test_the_docs_example_runs)",
}
"""A block's first line → why it cannot run against the gateway here, and where it runs instead."""

AFTERWARDS = {
    "def agent(": 'print("reward", agent({"question": "What is 17 + 25?", "answer": 42}, "{gateway}/v1"))',
}
"""A block that only defines something (its first line that starts so) → the line that uses it."""


def python_blocks() -> list[tuple[str, int, str]]:
    """``(page, index on the page, code)`` of every ```python block."""
    out = []
    for page in PAGES:
        for i, code in enumerate(re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)):
            out.append((page, i, code))
    return out


BLOCKS = python_blocks()


def _first_line(code: str, prefixes: dict[str, str]) -> str | None:
    return next((p for line in code.splitlines() for p in prefixes if line.startswith(p)), None)


@contextmanager
def serve_as_page_model(model_dir: Path, tmp: Path) -> Iterator[str]:
    """A gateway with the embedded engine on ``model_dir``, served as ``PAGE_MODEL`` (a model cache of its
    own names it so); yields its URL."""
    (tmp / "cache" / "models").mkdir(parents=True)
    (tmp / "cache" / "models" / PAGE_MODEL).symlink_to(model_dir, target_is_directory=True)
    port = free_port()
    args = ["tracegym", "serve", "--engine", "embedded", "--model", PAGE_MODEL, "--port", str(port),
            "--store", f"sqlite:///{tmp / 'tracegym.db'}"]
    env = {"TRACEGYM_CACHE": str(tmp / "cache"), "HF_HUB_OFFLINE": "1"}
    with start_process(args, port=port, log_path=tmp / "serve.log", health_path="/healthz", timeout=240, env=env):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve_as_page_model(tiny_model_dir, tmp_path_factory.mktemp("snippets")) as url:
        yield url


def run_block(code: str, gateway: str) -> subprocess.CompletedProcess[str]:
    script = code.replace(PAGE_GATEWAY, gateway)
    after = _first_line(code, AFTERWARDS)
    if after is not None:
        script += "\n" + AFTERWARDS[after].replace("{gateway}", gateway) + "\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEGYM_")}
    env |= {"TRACEGYM_MAX_TOKENS": "32"}  # the example agents' own cap (examples/openai/agent.py)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env)


def test_the_pages_have_python_blocks() -> None:
    pages = {page for page, _, _ in BLOCKS}
    assert "README.md" in pages and len(BLOCKS) >= 5
    # the Responses and Messages sections are among them
    assert any("client.responses.create" in code for _, _, code in BLOCKS)
    assert any("client.messages.create" in code for _, _, code in BLOCKS)
    unused = {p for p in NOT_RUN if not any(_first_line(c, {p: ""}) for _, _, c in BLOCKS)}
    assert not unused, f"NOT_RUN entries no block has: {unused}"


@pytest.mark.parametrize(("page", "index", "code"), BLOCKS, ids=[f"{p}-{i}" for p, i, _ in BLOCKS])
def test_python_block_runs_as_written(page: str, index: int, code: str, gateway: str) -> None:
    if (why := _first_line(code, NOT_RUN)) is not None:
        pytest.skip(NOT_RUN[why])
    if "run_agent(" in code:  # the runner needs rollouts in the queue: the README's enqueue puts them there
        tasks = [{"input": {"question": "What is 2 + 3?", "answer": 5}}] * 2
        httpx.post(gateway + "/api/tasks", json={"tasks": tasks, "group_size": 1}, timeout=30).raise_for_status()
    res = run_block(code, gateway)
    assert res.returncode == 0, f"{page} python block {index} failed:\n{code}\n{res.stderr[-3000:]}"
    if "run_agent(" in code:
        done, failed, _ = res.stdout.split()[-3:]
        assert (int(done), int(failed)) == (2, 0), res.stdout
    if _first_line(code, AFTERWARDS):
        assert re.search(r"^reward (0\.0|1\.0)$", res.stdout, flags=re.M), res.stdout


def test_responses_block_sends_the_tool_result_back(qwen3_model_dir: Path, tmp_path: Path) -> None:
    """Tiny-random never calls the tool, so the Responses block's second call runs here against a model
    scripted to call ``add`` (``tests/e2e/scripted_qwen3.py``): the block sends the tool's result back under
    ``previous_response_id``."""
    from tests.e2e.scripted_qwen3 import build_scripted_qwen3

    build_scripted_qwen3(qwen3_model_dir, tmp_path / "scripted")
    code = next(code for _, _, code in BLOCKS if "client.responses.create" in code)
    with serve_as_page_model(tmp_path / "scripted", tmp_path / "gw") as url:
        res = run_block(code + '\nprint("called", call.name, "then", r.previous_response_id is not None)\n', url)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "called add then True", res.stdout
