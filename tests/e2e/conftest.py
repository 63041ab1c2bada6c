"""One `tracegym serve --engine embedded --model tiny-random` (gateway + engine child + SQLite store) for
every e2e module that does not change the engine's weights; a module that does (test_swap) overrides
``gateway`` with its own. Also the plumbing of the tests that train through ``tracegym train``: a run's
metrics rows, an example's recipe trained shortened, and a chained sft → grpo recipe shortened."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.procs import ManagedProcess, free_port, start_process

ROOT = Path(__file__).resolve().parents[2]


def serve_tiny(tmp: Path, *extra: str) -> ManagedProcess:
    """A gateway with the embedded engine on tiny-random and a SQLite store in ``tmp``."""
    port = free_port()
    argv = ["tracegym", "serve", "--engine", "embedded", "--model", "tiny-random", "--port", str(port),
            "--store", f"sqlite:///{tmp / 'tracegym.db'}", *extra]  # fmt: skip
    return start_process(argv, port=port, log_path=tmp / "gateway.log", health_path="/healthz", timeout=240)


def engine_state(gw: ManagedProcess) -> dict[str, Any]:
    """The scheduler counters of the one engine behind ``gw`` (its ``/get_server_info``; the gateway's
    ``/api/upstreams`` names the engine)."""
    (engine,) = httpx.get(gw.base_url + "/api/upstreams", timeout=30).json()["engines"]
    return httpx.get(engine["url"] + "/get_server_info", timeout=30).json()["internal_states"][0]


def swap_while_generating(gw: ManagedProcess, call: Callable[[], Any], swap: Callable[[], Any],
                          timeout: float = 180) -> tuple[Any, Any]:
    """``call()`` (a long generation through ``gw``) in a thread, and ``swap()`` once the engine is decoding
    it (a running request, and tokens generated since the call began): a swap sent after a fixed sleep landed
    after the generation's end on a loaded machine. Returns both results."""
    before = engine_state(gw)["tokens_generated"]
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", call()))
    thread.start()
    deadline = time.monotonic() + 60
    while True:
        state = engine_state(gw)
        if state["running_requests"] and state["tokens_generated"] > before:
            break
        assert thread.is_alive() and time.monotonic() < deadline, f"the call never ran in the engine: {state}"
        time.sleep(0.05)
    swapped = swap()
    thread.join(timeout=timeout)
    assert "r" in out, "the call did not return"
    return out["r"], swapped


def metrics_rows(run: Path) -> list[dict[str, Any]]:
    """The rows of a run directory's ``metrics.jsonl``."""
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def train_example_shortened(
    example: Path,
    tmp: Path,
    steps: int,
    timeout: float,
    eval_tasks: int | None = None,
    lr: float | None = None,
    recipe_file: str = "recipe.yaml",
    **overrides: Any,
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """``tracegym train`` of an example's recipe (``example``: its directory; ``recipe_file`` in it) for
    ``steps`` steps, evaluated at the start and the end only, on its held-out tasks (the first ``eval_tasks``
    of them, or all), with learning rate ``lr`` instead of the recipe's when given; run in ``tmp`` (run
    directory ``tmp/run``), the example's dataset files (``sft.files``, ``dpo.files``) read where they are;
    ``overrides`` replace top-level recipe keys (``keep``, ``objective``, ``distill``, ...). The run must
    succeed. Returns the finished process and the run's metrics rows."""
    recipe = yaml.safe_load((example / recipe_file).read_text())
    eval_path = example / "eval.jsonl"
    if eval_tasks is not None:
        held = eval_path.read_text().splitlines()[:eval_tasks]
        eval_path = tmp / "eval.jsonl"
        eval_path.write_text("\n".join(held) + "\n")
    recipe.update(
        steps=steps,
        eval_interval=0,
        run_dir=str(tmp / "run"),
        data={"path": str(example / "train.jsonl"), "eval_path": str(eval_path)},
        **overrides,
    )
    if lr is not None:
        recipe["optim"]["lr"] = lr
    recipe["agent"]["target"] = f"{example / 'agent.py'}:agent"
    for section in ("sft", "dpo"):
        if recipe.get(section, {}).get("files"):
            recipe[section]["files"] = [str(example / f) for f in recipe[section]["files"]]
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    res = subprocess.run(
        [sys.executable, "-m", "tracegym.cli", "train", str(path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ},
        cwd=tmp,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return res, metrics_rows(tmp / "run")


def shortened_sft_grpo(recipe: Path, tmp: Path, sft_steps: int, grpo_steps: int, eval_tasks: int) -> Path:
    """An example's chained recipe (an sft phase on its ``sft.files``, then grpo) shortened to ``sft_steps``
    and ``grpo_steps``, evaluated before, at the end of the sft phase and at the end on its first
    ``eval_tasks`` held-out tasks × 2 samples, run directory ``tmp/run``; its agent (``agent.target``'s
    module, a file beside the recipe), tasks and demonstrations stay the example's. Returns the shortened
    recipe's path, in ``tmp``."""
    example = recipe.parent
    raw = yaml.safe_load(recipe.read_text())
    held = (example / raw["data"]["eval_path"]).read_text().splitlines()[:eval_tasks]
    (tmp / "eval.jsonl").write_text("\n".join(held) + "\n")
    raw.update(
        phases=[{"objective": "sft", "steps": sft_steps}, {"objective": "grpo", "steps": grpo_steps}],
        eval_interval=0, eval_samples=2, run_dir=str(tmp / "run"),
        data={"path": str(example / raw["data"]["path"]), "eval_path": str(tmp / "eval.jsonl")},
    )  # fmt: skip
    module, function = raw["agent"]["target"].split(":")
    raw["agent"]["target"] = f"{example / (module + '.py')}:{function}"
    raw["sft"]["files"] = [str(example / f) for f in raw["sft"]["files"]]
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def sft_grpo_evaluations(
    recipe: Path, tmp: Path, sft_steps: int, grpo_steps: int, eval_tasks: int, label: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``tracegym train`` of ``shortened_sft_grpo(recipe, ...)``; checks that it succeeded, that it evaluated
    before, at the end of the sft phase and at the end, that the sft steps read 16 imported demonstrations
    each and sampled nothing and that the grpo steps sampled; prints the curve under ``label``. Returns the
    three evaluations' metrics rows."""
    path = shortened_sft_grpo(recipe, tmp, sft_steps, grpo_steps, eval_tasks)
    res = subprocess.run(
        [sys.executable, "-m", "tracegym.cli", "train", str(path)], cwd=tmp,
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    rows = metrics_rows(tmp / "run")
    train = [r for r in rows if r["kind"] == "train"]
    before, sft, grpo = evals = [r for r in rows if r["kind"] == "eval"]
    curve = " -> ".join(f"step {r['step']}: reward {r['reward_mean']:.3f}, valid calls {r['emitted/valid_call']:.2f}"
                        for r in evals)  # fmt: skip
    print(f"{label} sft -> grpo: {curve}")
    assert [r["step"] for r in evals] == [0, sft_steps, sft_steps + grpo_steps]
    assert all(r["sft_rollouts"] == 16 and "gen_s" not in r for r in train[:sft_steps]), train
    assert all("gen_s" in r for r in train[sft_steps:]), train
    return before, sft, grpo


QUICKSTART = ROOT / "examples" / "quickstart"
QUICKSTART_STEPS = 18
"""Steps of the shortened quickstart, at 3x the recipe's learning rate (LEARNING_PROBE: lr 3e-5 learns fastest
early): 8 steps rose the held-out reward by +0.16 to +0.63 over runs and once, in CI, not at all; 14 steps by
+0.55 and +0.59 with bf16, but +0.21 on a CPU that computes in fp32."""


@pytest.fixture(scope="session")
def quickstart_trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The quickstart shortened (``QUICKSTART_STEPS``), SmolLM2-135M through the whole product, its trained
    weights kept: ``(the run directory, its metrics rows)``. test_quickstart checks its rise; the
    distillation test takes it as the teacher, so one training serves both."""
    tmp = tmp_path_factory.mktemp("quickstart")
    _, rows = train_example_shortened(QUICKSTART, tmp, QUICKSTART_STEPS, timeout=1500, lr=3.0e-5, keep="weights")
    return tmp / "run", rows


@pytest.fixture(scope="session")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    # a small body limit so the 413 case is cheap to provoke (test_openai_client)
    with serve_tiny(tmp_path_factory.mktemp("e2e-gateway"), "--max-body-bytes", "200000") as gw:
        yield gw
