"""The trace inspector in a real browser (Debian's chromium driven by Playwright) after a short real run:
``tracegym train`` on tiny-random with an agent whose rollouts have multi-turn calls, a forked (drifted)
call, a streamed call cut off by the agent (an error, excluded from training) and a failing task. Then
``tracegym serve`` on the run's store serves ``/ui`` and each page is checked against the JSON API.

Screenshots of every page go to ``$TRACEGYM_ARTIFACTS`` (default ``test-artifacts/`` in the repo)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.procs import free_port, start_process

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("TRACEGYM_ARTIFACTS", ROOT / "test-artifacts")) / "inspector"
RUN = "inspect-run"
TASKS = [
    {"task_id": "plain", "input": {"question": "Say one"}},
    {"task_id": "edit", "input": {"question": "Say two", "edit": True}},
    {"task_id": "cut", "input": {"question": "Say three", "cut": True}},
    {"task_id": "fail", "input": {"question": "Say four", "fail": True}},
]

pytestmark = pytest.mark.slow


def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs Debian's chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return path


def _train(tmp: Path) -> subprocess.CompletedProcess:
    (tmp / "train.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    (tmp / "eval.jsonl").write_text(json.dumps({"task_id": "held-out", "input": {"question": "Say five"}}) + "\n")
    recipe = {
        "name": RUN, "model": "tiny-random", "data": {"path": "train.jsonl", "eval_path": "eval.jsonl"},
        "agent": {"target": "tests.e2e.agents.inspect_agent:agent", "concurrency": 8},
        "group_size": 2, "batch_size": 2, "steps": 2, "eval_interval": 0, "eval_samples": 2,
        "algorithm": {"drop_zero_signal_groups": False},
        "optim": {"lr": 1e-3, "dtype": "float32"}, "upstream": {"engine_dtype": "float32"},
        "run_dir": str(tmp / "run"),
    }
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return subprocess.run([sys.executable, "-m", "tracegym.cli", "train", str(tmp / "recipe.yaml")], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The finished run's store behind a gateway (its upstream is a URL nobody serves: the inspector reads
    only the store and the tokenizer), and what the run printed."""
    tmp = tmp_path_factory.mktemp("inspector")
    res = _train(tmp)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    port = free_port()
    argv = ["tracegym", "serve", "--port", str(port), "--store", f"sqlite:///{tmp / 'run' / 'tracegym.db'}",
            "--upstream", "http://127.0.0.1:9/v1", "--upstream-kind", "openai", "--model", "tiny-random"]
    with start_process(argv, port=port, log_path=tmp / "serve.log", health_path="/healthz", timeout=120):
        yield {"url": f"http://127.0.0.1:{port}", "stderr": res.stderr, "tmp": tmp}


@pytest.fixture(scope="module")
def browser(served: dict[str, Any]) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


class Page:
    """A browser tab that records console errors and failed requests, and waits for the app to draw."""

    def __init__(self, browser: Any, url: str) -> None:
        self.url = url
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def open(self, path: str) -> Any:
        self.page.goto(self.url + path)
        self.ready()
        return self.page

    def ready(self) -> None:
        self.page.wait_for_selector("body[data-ready='1']", timeout=20_000)
        self.page.wait_for_load_state("networkidle")

    def shot(self, name: str, full: bool = False) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=full)


def _api(served: dict[str, Any], path: str, **params: Any) -> Any:
    resp = httpx.get(served["url"] + path, params=params, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _by_task(served: dict[str, Any]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in _api(served, "/api/rollouts", limit=500)["rollouts"]:
        out.setdefault(r["task_id"], []).append(r)
    return out


def test_train_prints_the_inspector_url(served: dict[str, Any]) -> None:
    assert "trace inspector: http://127.0.0.1:" in served["stderr"] and f"/ui/runs/{RUN}" in served["stderr"]


def test_runs_page_draws_the_runs_curves(served: dict[str, Any], browser: Any) -> None:
    tab = Page(browser, served["url"])
    page = tab.open(f"/ui/runs/{RUN}")
    assert page.locator("table.runs tr.selected").inner_text().startswith(RUN)
    reward = page.locator(".chart[data-metric='Reward mean']")
    assert int(reward.get_attribute("data-points")) >= 2  # train steps 1, 2 (and evaluations)
    assert reward.locator("canvas").count() == 1
    assert int(page.locator(".chart[data-metric='Held-out eval reward']").get_attribute("data-points")) >= 1
    tab.shot("runs")
    page.locator("input[name=axis][value=time]").check()
    assert int(page.locator(".chart[data-metric='Reward mean']").get_attribute("data-points")) >= 2
    tab.shot("runs-time")
    assert tab.errors == []


def test_rollouts_table_follows_the_filters(served: dict[str, Any], browser: Any) -> None:
    tab = Page(browser, served["url"])
    page = tab.open("/ui/rollouts")
    everything = _api(served, "/api/rollouts", limit=500)["rollouts"]
    assert page.locator("table.rollouts tbody tr").count() == min(50, len(everything))
    tab.shot("rollouts")
    page.locator("#filters select[name=status]").select_option("failed")
    page.locator("#filters button[type=submit]").click()
    tab.ready()
    failed = {r["rollout_id"] for r in everything if r["status"] == "failed"}
    assert failed and {e.get_attribute("data-rollout") for e in page.locator("table.rollouts tbody tr").all()} == failed
    assert "status=failed" in page.url
    page.locator("#filters select[name=status]").select_option("")
    page.locator("#filters select[name=has_drift]").select_option("true")
    page.locator("#filters button[type=submit]").click()
    tab.ready()
    drifted = set()
    for r in everything:
        spans = _api(served, f"/api/rollouts/{r['rollout_id']}/spans")["spans"]
        if any(s["attributes"].get("tracegym.drift") in ("realigned", "forked") for s in spans):
            drifted.add(r["rollout_id"])
    assert {r["rollout_id"] for r in _by_task(served)["edit"]} <= drifted  # the rewritten reply forks
    assert {e.get_attribute("data-rollout") for e in page.locator("table.rollouts tbody tr").all()} == drifted
    page.locator("#filters input[name=q]").fill("edit")  # a task id
    page.locator("#filters button[type=submit]").click()
    tab.ready()
    shown = {e.get_attribute("data-rollout") for e in page.locator("table.rollouts tbody tr").all()}
    assert shown == {r["rollout_id"] for r in _by_task(served)["edit"]}
    assert tab.errors == []


def test_rollout_page_shows_calls_and_the_trained_tokens(served: dict[str, Any], browser: Any) -> None:
    tab = Page(browser, served["url"])
    rid = next(r["rollout_id"] for r in _by_task(served)["cut"] if r["status"] == "completed")
    page = tab.open(f"/ui/rollouts/{rid}")
    trajectory = _api(served, f"/api/rollouts/{rid}/trajectory")  # the trainer's view, not the inspector's
    sampled = sum(sum(s["loss_mask"]) for s in trajectory["sequences"])
    assert sampled > 0 and page.locator(".tokens .tok.s").count() == sampled
    total = sum(len(s["token_ids"]) for s in trajectory["sequences"])
    assert page.locator(".tokens .tok").count() == total
    assert page.locator("table.calls tr.call").count() == 4  # three turns and the cut stream
    assert page.locator("table.calls tr.call.err").count() == 1
    assert "excluded: error" in page.locator("table.calls tr.call.err").inner_text()
    assert [e["reason"] for e in trajectory["excluded"]] == ["error"]
    assert page.locator(".excluded tbody tr").count() == 1
    page.locator("table.calls tr.call").first.click()
    assert "Say three" in page.locator("tr.call-detail").first.inner_text()
    page.locator(".tokens .tok.s").first.hover()
    tip = page.locator("#tip")
    assert tip.is_visible() and "engine logprob" in tip.inner_text() and "loss mask" in tip.inner_text()
    tab.shot("rollout-tokens")
    page.locator("#copy-export").click()
    page.wait_for_function("document.querySelector('#copy-export').nextElementSibling.textContent !== ''")
    command = page.locator("#export-cmd").inner_text()
    assert command.startswith("tracegym export ") and rid in command
    out = served["tmp"] / "exported.jsonl"
    argv = command.replace(f"--out {rid}.jsonl", f"--out {out}").split()
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    (line,) = out.read_text().splitlines()
    assert json.loads(line)["rollout_id"] == rid
    assert tab.errors == []


def test_forked_rollout_has_a_fork_marker_per_sequence(served: dict[str, Any], browser: Any) -> None:
    tab = Page(browser, served["url"])
    rid = _by_task(served)["edit"][0]["rollout_id"]
    page = tab.open(f"/ui/rollouts/{rid}")
    trajectory = _api(served, f"/api/rollouts/{rid}/trajectory")
    assert page.locator(".sequence").count() == len(trajectory["sequences"]) == 2
    assert page.locator(".mark.drift-forked").count() == 1
    page.locator("input[name=mode][value=per_call]").check()
    tab.ready()
    assert page.locator(".sequence").count() == 3 and "mode=per_call" in page.url
    assert tab.errors == []


def test_group_and_system_pages(served: dict[str, Any], browser: Any) -> None:
    tab = Page(browser, served["url"])
    plain = _by_task(served)["plain"][0]
    page = tab.open(f"/ui/groups/{plain['group_id']}")
    assert page.locator(".member").count() == 2
    tab.shot("group")
    page = tab.open("/ui/system")
    failed = [r for r in _api(served, "/api/rollouts", status="failed")["rollouts"]]
    assert int(page.locator(".stat[data-status=failed] .n").inner_text()) == len(failed) >= 1
    assert page.locator("details.failure").count() == len(failed)
    page.locator("details.failure summary").first.click()
    assert "fails on purpose" in page.locator("details.failure pre").first.inner_text()
    assert page.locator("#dropped .n").inner_text() == "0"
    tab.shot("system", full=True)
    assert tab.errors == []


def test_admin_key_from_the_login_form_goes_on_every_request(served: dict[str, Any], browser: Any) -> None:
    tab = Page(browser, served["url"])
    page = tab.open("/ui/system")
    seen: list[str | None] = []
    page.on("request", lambda r: seen.append(r.headers.get("authorization")) if "/api/" in r.url else None)
    page.locator("#auth button").click()
    page.locator("form.login input[name=key]").fill("s3cret")
    page.locator("form.login button[type=submit]").click()
    tab.ready()
    assert seen and set(seen) == {"Bearer s3cret"}
    assert page.evaluate("sessionStorage.getItem('tracegym.admin_key')") == "s3cret"
    page.locator("#auth button").click()  # forget it
    assert page.evaluate("sessionStorage.getItem('tracegym.admin_key')") is None
    assert tab.errors == []


def test_a_keyed_gateway_serves_the_page_and_asks_for_the_key(served: dict[str, Any], browser: Any) -> None:
    """The same store behind a gateway with an admin key: the page loads without it, its data asks for it
    (the login form), a wrong key is asked again, the right one shows the page."""
    port = free_port()
    argv = ["tracegym", "serve", "--port", str(port), "--store", f"sqlite:///{served['tmp'] / 'run' / 'tracegym.db'}",
            "--upstream", "http://127.0.0.1:9/v1", "--upstream-kind", "openai", "--model", "tiny-random"]
    with start_process(argv, port=port, log_path=served["tmp"] / "keyed.log", health_path="/healthz", timeout=120,
                       env={"TRACEGYM_ADMIN_KEY": "k-browser"}):
        tab = Page(browser, f"http://127.0.0.1:{port}")
        page = tab.open("/ui/system")
        assert page.locator("form.login").count() == 1
        for key in ("wrong", "k-browser"):
            page.locator("form.login input[name=key]").fill(key)
            page.locator("form.login button[type=submit]").click()
            tab.ready()
        assert page.locator("form.login").count() == 0
        assert int(page.locator(".stat[data-status=failed] .n").inner_text()) >= 1
        # the only console errors are the refused reads before the right key was entered
        assert all("401" in e for e in tab.errors), tab.errors


def test_system_page_lists_each_engine_of_a_fleet(served: dict[str, Any], browser: Any) -> None:
    """The same store behind a gateway with two SGLang upstreams nobody serves: both engines are listed,
    unhealthy, with why."""
    port = free_port()
    ups = ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    argv = ["tracegym", "serve", "--port", str(port), "--store", f"sqlite:///{served['tmp'] / 'run' / 'tracegym.db'}",
            "--upstream", ups[0], "--upstream", ups[1], "--upstream-kind", "sglang", "--model", "tiny-random"]
    with start_process(argv, port=port, log_path=served["tmp"] / "fleet.log", health_path="/healthz", timeout=120):
        tab = Page(browser, f"http://127.0.0.1:{port}")
        page = tab.open("/ui/system")
        rows = page.locator("tr.engine")
        assert [rows.nth(i).get_attribute("data-url") for i in range(rows.count())] == ups
        assert all("no" in rows.nth(i).inner_text() for i in range(2))
        assert tab.errors == []
