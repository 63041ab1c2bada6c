"""``kill -9`` of ``tracegym train`` while it collects a step's groups (after its first checkpoint), then
``--resume``: the run continues from the checkpoint and trains that step on the groups it had queued, the
rollouts already completed in the store included; no completed rollout runs again and none is lost."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
GROUP, BATCH, STEPS = 4, 2, 3
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TRACEGYM_TEST_AGENT_SLEEP": "1"}


def _recipe(tmp: Path) -> Path:
    tasks = [{"task_id": f"t{i}", "input": {"question": f"Say {i}"}} for i in range(10)]
    (tmp / "train.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks[:8]))
    (tmp / "eval.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks[8:]))
    recipe = {
        "name": "killtest", "model": "tiny-random",
        "data": {"path": "train.jsonl", "eval_path": "eval.jsonl"},
        # two at a time, a second each: a step's 8 rollouts take ~4 s, so the kill lands mid-group
        "agent": {"target": "tests.e2e.agents.slow_length_agent:agent", "concurrency": 2, "lease_seconds": 5},
        "group_size": GROUP, "batch_size": BATCH, "steps": STEPS, "eval_interval": 0, "eval_samples": 1,
        "checkpoint_interval": 1, "optim": {"lr": 1e-3, "dtype": "float32"},
        "upstream": {"engine_dtype": "float32"}, "run_dir": str(tmp / "run"),
    }
    p = tmp / "recipe.yaml"
    p.write_text(yaml.safe_dump(recipe))
    return p


def _rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql).fetchall()


def _completed(db: Path) -> dict[str, tuple]:
    """Completed training rollouts: id -> (group, attempt, finished_at, spans)."""
    rows = _rows(db, "SELECT r.rollout_id, r.group_id, r.attempt, r.finished_at, "
                     "(SELECT COUNT(*) FROM spans s WHERE s.rollout_id = r.rollout_id) FROM rollouts r "
                     "WHERE r.status = 'completed' AND r.group_id LIKE '%-train-%'")
    return {r[0]: r[1:] for r in rows}


def _wait_mid_group(run: Path, err: Path, proc: subprocess.Popen) -> str:
    """The gateway's URL, once step 1's checkpoint is written and step 2's groups are part done."""
    deadline = time.monotonic() + 600
    url = None
    while time.monotonic() < deadline:
        assert proc.poll() is None, err.read_text()[-5000:]
        if url is None and (m := re.search(r"trace inspector: (http://[0-9.:]+)/ui", err.read_text())):
            url = m.group(1)
        if url is not None and (run / "checkpoint" / "trainer_state.json").is_file():
            key = (run / "admin_key").read_text().strip()  # the run's gateway needs its key (docs/security.md)
            rows = httpx.get(f"{url}/api/rollouts", params={"limit": 500}, timeout=30,
                             headers={"Authorization": f"Bearer {key}"}).json()["rollouts"]
            step2 = [r for r in rows if r["group_id"] and r["group_id"].endswith(("-train-2", "-train-3"))]
            done = sum(r["status"] == "completed" for r in step2)
            if 0 < done < len(step2):
                return url
        time.sleep(0.1)
    raise AssertionError("step 2 never got under way: " + err.read_text()[-5000:])


@pytest.mark.slow
def test_kill_9_mid_group_then_resume_uses_the_completed_rollouts(tmp_path: Path, tiny_model_dir: Path) -> None:
    recipe, run = _recipe(tmp_path), tmp_path / "run"
    err = tmp_path / "train.err"
    with open(err, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "tracegym.cli", "train", str(recipe)], cwd=ROOT, env=ENV,
                                stdout=subprocess.DEVNULL, stderr=f)
    try:
        url = _wait_mid_group(run, err, proc)
    finally:
        proc.send_signal(signal.SIGKILL)  # its engine, gateway and runner get SIGTERM (PR_SET_PDEATHSIG)
        proc.wait(30)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the old gateway drains its requests, then is gone
        try:
            httpx.get(url + "/healthz", timeout=1)
        except httpx.HTTPError:
            break
        time.sleep(0.2)
    db = run / "tracegym.db"
    before = _completed(db)
    step2_before = {rid: v for rid, v in before.items() if v[0].endswith(("-train-2", "-train-3"))}
    assert step2_before, "no rollout of step 2 had completed at the kill"

    res = subprocess.run([sys.executable, "-m", "tracegym.cli", "train", str(recipe), "--resume"], cwd=ROOT,
                         env=ENV, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]  # from the checkpoint at step 1, step 2 done once
    assert train[1]["rollouts"] == BATCH * GROUP and train[1]["dropped_rollouts"] == 0

    groups = _rows(db, "SELECT group_id, COUNT(*) FROM rollouts WHERE group_id LIKE '%-train-%' GROUP BY group_id")
    assert len(groups) == STEPS * BATCH and all(n == GROUP for _, n in groups), groups  # none queued twice
    after = _completed(db)
    assert len(after) == STEPS * BATCH * GROUP
    for rid, (group, attempt, finished, spans) in before.items():  # not lost, not run again
        assert after[rid] == (group, attempt, finished, spans), rid
