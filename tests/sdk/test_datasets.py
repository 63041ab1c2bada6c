"""``tracegym import`` and ``tracegym export`` of the dataset forms against a real gateway app (tiny-random's
chat template, a SQLite store; no inference is made): chat demonstrations in, then sft, dpo, trajectories
and a parquet dataset out, the parquet opened by ``datasets`` and imported back token for token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway.app_support import ServerThread
from tracegym.cli import main as cli
from tracegym.datasets import dpo_pairs, run_of

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def _conv(colour: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": f"Secret code of {colour}?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "lookup", "arguments": json.dumps({"colour": colour})}}]},
            {"role": "tool", "tool_call_id": "c1", "content": f"{colour[0].upper()}-1"},
            {"role": "assistant", "content": answer}]


@pytest.fixture
def gateway(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from tracegym.gateway.app import create_app
    from tracegym.gateway.settings import GatewaySettings

    settings = GatewaySettings(upstream_url="http://127.0.0.1:9", model=str(tiny_model_dir),
                               store_url=f"sqlite:///{tmp_path / 'tg.db'}")
    with ServerThread(create_app(settings)) as srv:
        monkeypatch.setenv("TRACEGYM_GATEWAY", srv.url)
        yield srv.url


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_run_of_names_runs_and_imports() -> None:
    assert run_of("quickstart-0123456789abcdef-train-12") == "quickstart"
    assert run_of("my-run-0123456789abcdef-eval3-0") == "my-run"
    assert run_of("demos-import-7") == "demos"
    assert run_of("grp_abc") is None and run_of(None) is None


def test_dpo_pairs_take_best_and_worst_of_a_group_with_one_prompt() -> None:
    p = [{"role": "user", "content": "q"}]
    recs = [{"group_id": "g", "reward": r, "messages": [*p, {"role": "assistant", "content": str(r)}]}
            for r in (0.0, 1.0, 0.5)]
    recs.append({"group_id": "h", "reward": 1.0, "messages": [*p, {"role": "assistant", "content": "x"}]})
    recs.append({"group_id": "h", "reward": 0.0, "messages": [{"role": "user", "content": "other"},
                                                              {"role": "assistant", "content": "y"}]})
    (pair,) = dpo_pairs(recs)
    assert pair["chosen"] == [{"role": "assistant", "content": "1.0"}] and pair["rejected"][0]["content"] == "0.0"
    assert pair["prompt"] == p and pair["group_id"] == "g"


def test_chat_in_then_every_form_out_and_back(gateway: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    demos = _jsonl(tmp_path / "demos.jsonl", [
        {"messages": _conv("red", "It is R-1."), "tools": TOOLS, "reward": 1.0},
        {"messages": _conv("blue", "It is B-1."), "tools": TOOLS, "reward": 0.5},
    ])
    assert cli(["import", str(demos), "--name", "demos"]) == 0
    assert "imported 2 rollouts in 2 groups (4 calls)" in capsys.readouterr().err
    assert cli(["import", str(demos), "--name", "demos"]) == 0  # again: nothing added
    assert "imported 0 rollouts in 0 groups (0 calls)" in capsys.readouterr().err

    assert cli(["export", "--out", str(tmp_path / "sft.jsonl"), "--format", "sft"]) == 0
    sft = [json.loads(x) for x in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert sorted(r["messages"][-1]["content"] for r in sft) == ["It is B-1.", "It is R-1."]
    assert {r["group_id"] for r in sft} == {"demos-import-1", "demos-import-2"} and all(r["tools"] for r in sft)

    # a preference pair in, a dpo file out (one pair per group with two rewards)
    pairs = _jsonl(tmp_path / "pairs.jsonl", [{"prompt": [{"role": "user", "content": "Say hi"}],
                                               "chosen": {"role": "assistant", "content": "hi"},
                                               "rejected": {"role": "assistant", "content": "bye"}}])
    assert cli(["import", str(pairs), "--name", "prefs", "--format", "dpo"]) == 0
    assert cli(["export", "--out", str(tmp_path / "dpo.jsonl"), "--format", "dpo"]) == 0
    (dpo,) = [json.loads(x) for x in (tmp_path / "dpo.jsonl").read_text().splitlines()]
    assert dpo["chosen"][0]["content"] == "hi" and dpo["rejected"][0]["content"] == "bye"
    assert dpo["chosen_reward"] == 1.0 and dpo["rejected_reward"] == 0.0


def test_hf_parquet_opens_with_datasets_and_imports_back_token_for_token(gateway: str, tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    from tracegym.client import GatewayClient

    demos = _jsonl(tmp_path / "demos.jsonl", [{"messages": _conv("red", "It is R-1."), "tools": TOOLS,
                                               "reward": 1.0}])
    assert cli(["import", str(demos), "--name", "demos"]) == 0
    out = tmp_path / "ds.parquet"
    assert cli(["export", "--out", str(out), "--format", "hf"]) == 0
    with GatewayClient() as c:
        traj = [json.loads(x) for x in c.iter_lines("/api/trajectories", "t", {"include_retokenized": "true"})]
    ds = datasets.load_dataset("parquet", data_files=str(out), split="train")
    assert ds.column_names == ["rollout_id", "task_id", "group_id", "run", "sequence", "messages", "tools",
                               "token_ids", "loss_mask", "logprobs", "reward", "weight_version", "weight_versions"]
    (row,) = ds
    assert row["run"] == "demos" and row["token_ids"] == traj[0]["sequences"][0]["token_ids"]
    assert json.loads(row["messages"])[-1]["content"] == "It is R-1." and json.loads(row["tools"]) == TOOLS
    assert row["reward"] == 1.0 and all(lp is None for lp in row["logprobs"])  # imported: never sampled

    assert cli(["import", str(out), "--name", "again", "--format", "hf"]) == 0
    with GatewayClient() as c:
        back = [json.loads(x) for x in c.iter_lines("/api/trajectories", "t", {"include_retokenized": "true"})]
    (again,) = [t for t in back if t["group_id"].startswith("again-import-")]
    assert again["sequences"][0]["token_ids"] == row["token_ids"]
    assert again["sequences"][0]["loss_mask"] == row["loss_mask"] and again["reward"] == 1.0


def test_an_empty_hf_export_says_so(gateway: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("pyarrow")
    assert cli(["export", "--out", str(tmp_path / "x.parquet"), "--format", "hf"]) == 2
    assert "no trajectory sequence matched" in capsys.readouterr().err


def test_a_refused_demonstration_names_its_line(gateway: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = _jsonl(tmp_path / "bad.jsonl", [{"messages": _conv("red", "ok"), "tools": TOOLS},
                                          {"messages": _conv("red", "ok")}])
    assert cli(["import", str(bad), "--name", "bad"]) == 2
    err = capsys.readouterr().err
    assert "line 2: messages[1] calls tool 'lookup', but the record offers no tools" in err
