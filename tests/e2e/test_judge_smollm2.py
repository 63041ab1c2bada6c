"""One `tracegym train` step on SmolLM2-135M-Instruct with `reward.judge` and no `base_url`: the run's own
gateway, SmolLM2, judges each group. A 135M model may or may not write a usable answer; either way every
rollout must end with exactly one of a score in [0, 1] or a clear judge error, the judge's calls must be
LLM spans of a judge rollout that no step trains on, and the step's metrics must count them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # SmolLM2 on a shared CPU: the judge's answer alone can take minutes
def test_smollm2_judges_a_training_step(tmp_path: Path) -> None:
    from tracegym.modelfiles.prepare import prepare_model

    prepare_model("smollm2-135m")
    (tmp_path / "train.jsonl").write_text("".join(
        json.dumps({"task_id": f"t{i}", "input": {"question": f"Name a colour. ({i})"}}) + "\n" for i in range(2)))
    recipe = {
        "name": "judgetest", "model": "smollm2-135m", "data": {"path": "train.jsonl", "eval_size": 0},
        "agent": {"target": "tests.e2e.agents.length_agent:agent", "concurrency": 4},
        "group_size": 2, "batch_size": 1, "steps": 1, "eval_interval": 0, "run_dir": str(tmp_path / "run"),
        "reward": {"agent_weight": 0.5, "judge": {
            "rubric": "Naming a colour is good.", "retries": 1, "max_tokens": 48, "max_chars": 200,
            "timeout_s": 900}},  # a CPU engine shared with other work can take minutes for one answer
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    res = subprocess.run([sys.executable, "-m", "tracegym.cli", "train", str(tmp_path / "recipe.yaml")],
                         cwd=ROOT, capture_output=True, text=True, timeout=1800,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    (row,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if json.loads(x)["kind"] == "train"]
    assert row["rollouts"] + row["dropped_rollouts"] == 2 and 1 <= row["judge_calls"] <= 2  # one group

    from tracegym.gateway.traces.reads import list_call_records
    from tracegym.gateway.traces.store import Store

    store = Store.open(f"sqlite:///{tmp_path / 'run' / 'tracegym.db'}")
    try:
        rollouts, _ = store.list_rollouts(limit=500)
        grouped = [r for r in rollouts if r["group_id"]]
        judges = [r for r in rollouts if r["rollout_id"].startswith("judge-")]
        assert len(grouped) == 2 and len(judges) == 1 and all(r["status"] == "adhoc" for r in judges)
        scored = failed = 0
        for r in grouped:
            events = {e["name"]: e for e in store.list_events(r["rollout_id"])}
            assert ("tracegym.judge" in events) != ("tracegym.judge_error" in events), events
            if "tracegym.judge" in events:
                ev = events["tracegym.judge"]
                assert 0.0 <= ev["value"] <= 1.0
                assert ev["attributes"]["reward"] == 0.5 * r["reward"] + ev["value"]
                scored += 1
            else:
                assert events["tracegym.judge_error"]["value"].startswith("judge failed after ")
                failed += 1
        assert (scored, failed) == (row["rollouts"], row["judge_failed"])
        judge_calls = [c for j in judges for c in list_call_records(store, j["rollout_id"])]
        assert len(judge_calls) == row["judge_calls"]
        assert all(c.agent_name == "tracegym-judge" and c.model == "smollm2-135m" for c in judge_calls)
        group_calls = {c.call_id for r in grouped for c in list_call_records(store, r["rollout_id"])}
        assert group_calls and not group_calls & {c.call_id for c in judge_calls}
    finally:
        store.close()
