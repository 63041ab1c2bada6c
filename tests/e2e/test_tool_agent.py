"""The tool-using agent (``examples/tool_agent``), shortened: SmolLM2-135M, 2-3 LLM calls per rollout with the
tool's results fed back, trained through the whole product. The held-out reward must at least double and rise
by 0.25, the agent must call the tool more often, and what it trained on must be merged multi-turn sequences:
at least two sampled (mask-1) segments each on average, with the tool results and nudges masked 0."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import train_example_shortened
from tests.procs import free_port, start_process

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples" / "tool_agent"
STEPS = 4
EVAL_TASKS = 32  # x 2 samples: the standard error of the difference is < 0.1 at the rates seen


@pytest.mark.slow
@pytest.mark.learns
def test_tool_agent_learns_to_call_its_tool(tmp_path: Path) -> None:
    res, rows = train_example_shortened(EX, tmp_path, STEPS, timeout=1200, eval_tasks=EVAL_TASKS)
    evals = [r for r in rows if r["kind"] == "eval"]
    train = [r for r in rows if r["kind"] == "train"]
    before, after = evals[0], evals[-1]
    print(f"tool agent ({STEPS} steps): eval reward {before['reward_mean']:.3f} -> {after['reward_mean']:.3f}, "
          f"tool calls {before['emitted/tool_call']:.2f} -> {after['emitted/tool_call']:.2f}, "
          f"valid {before['emitted/valid_call']:.2f} -> {after['emitted/valid_call']:.2f}")
    assert after["reward_mean"] >= max(2 * before["reward_mean"], before["reward_mean"] + 0.25), (before, after)
    assert after["emitted/valid_call"] >= before["emitted/valid_call"] + 0.25
    assert "eval tool_call (tg.emit mean)" in res.stdout + res.stderr  # the summary shows the behaviour
    assert len(train) == STEPS
    # what was trained on: merged multi-turn sequences (one sampled segment per LLM call)
    segments = [r["sampled_segments"] for r in train if "sampled_segments" in r]
    assert segments and statistics.fmean(segments) >= 2.0, segments
    check_tool_results_masked(tmp_path)


def check_tool_results_masked(tmp_path: Path) -> None:
    """Reads the run's store back through a gateway: in every trained rollout's sequence, the tool results and
    nudges the agent fed back sit in mask-0 tokens, and no mask-1 run holds them."""
    from tokenizers import Tokenizer

    from tracegym.modelfiles.prepare import prepare_model

    tok = Tokenizer.from_file(str(prepare_model("smollm2-135m") / "tokenizer.json"))
    port = free_port()
    argv = ["tracegym", "serve", "--model", "smollm2-135m", "--port", str(port),  # reads only: any upstream
            "--upstream", "http://127.0.0.1:9/v1", "--upstream-kind", "openai",
            "--store", f"sqlite:///{tmp_path / 'run' / 'tracegym.db'}"]
    with start_process(argv, port=port, log_path=tmp_path / "serve.log", health_path="/healthz", timeout=120) as gw:
        lines = httpx.get(f"{gw.base_url}/api/trajectories", params={"status": "completed", "limit": 100},
                          timeout=120).text.splitlines()
    seqs = [s for line in lines for s in json.loads(line)["sequences"]]
    assert len(seqs) >= 50
    fed_back = 0
    for s in seqs:
        ids, mask = s["token_ids"], s["loss_mask"]
        runs: list[tuple[int, list[int]]] = []  # (mask, ids) runs
        for t, m in zip(ids, mask, strict=True):
            if runs and runs[-1][0] == m:
                runs[-1][1].append(t)
            else:
                runs.append((m, [t]))
        sampled = [tok.decode(r) for m, r in runs if m == 1]
        between = [tok.decode(r) for m, r in runs[1:] if m == 0]  # after the first prompt
        assert len(sampled) >= 2, s  # every rollout makes at least two calls, merged into one sequence
        assert not any("You did not look it up" in x for x in sampled)
        fed = [x for x in between if "RESULT " in x or "You did not look it up" in x]
        assert len(fed) == len(sampled) - 1, (sampled, between)  # one tool result or nudge between two calls
        fed_back += len(fed)
    assert fed_back >= len(seqs)
