"""``tracegym.judge``: parsing a judge's answer id by id, the prompt, and the retrying loop against a real
scripted judge process (tests/sdk/scripted_judge.py) that answers well, badly, or with HTTP errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.sdk.scripted_judge import read_log, scripted_judge
from tracegym.judge import (
    ANSWER,
    Candidate,
    JudgeError,
    JudgeSettings,
    build_messages,
    combine,
    judge_group,
    parse_scores,
    render_conversation,
)

IDS = ["r1", "r2", "r3"]
RUBRIC = "The answer is correct and short."


def _answer(**scores: object) -> str:
    return json.dumps({"scores": [{"id": k, "explanation": f"why {k}", "score": v} for k, v in scores.items()]})


def test_parse_the_asked_form() -> None:
    ok, problems = parse_scores(_answer(r1=0.0, r2=1, r3=0.25), IDS)
    assert problems == {}
    assert ok == {"r1": (0.0, "why r1"), "r2": (1.0, "why r2"), "r3": (0.25, "why r3")}


@pytest.mark.parametrize("text", [
    "Sure! Here are the scores:\n```json\n" + _answer(r1=0.1, r2=0.2, r3=0.3) + "\n```\nDone.",
    "<think>r1 is worse {not json}</think>" + _answer(r1=0.1, r2=0.2, r3=0.3),
    json.dumps([{"trajectory_id": "R1", "score": 0.1}, {"id": "r2", "score": "0.2"}, {"id": "r3", "score": 0.3}]),
    json.dumps({"r1": 0.1, "r2": {"score": 0.2}, "r3": 0.3}),
    "r1: 0.1\nr2 = 0.2\n- r3: 0.3",
])
def test_parse_other_usable_forms(text: str) -> None:
    ok, problems = parse_scores(text, IDS)
    assert problems == {} and {k: v[0] for k, v in ok.items()} == {"r1": 0.1, "r2": 0.2, "r3": 0.3}


@pytest.mark.parametrize(("text", "expected"), [
    (_answer(r1=0.5, r2=0.5), {"r3": "missing from the answer"}),
    ('{"score": 0.5, "id": "r1", "explanation": "one entry"}', {"r2": "missing from the answer",
                                                               "r3": "missing from the answer"}),
    (_answer(r1=0.5, r2=1.5, r3=-0.1), {"r2": "score 1.5 is out of range [0, 1]",
                                         "r3": "score -0.1 is out of range [0, 1]"}),
    (_answer(r1=0.5, r2="good", r3=True), {"r2": "score is not a number: 'good'", "r3": "score is not a number: True"}),
    ('{"scores": [{"id": "r1", "score": NaN}, {"id": "r2", "score": 1}, {"id": "r3", "score": 1}]}',
     {"r1": "score is not finite: nan"}),
    (json.dumps({"scores": [{"id": "r1", "score": 0.1}, {"id": "r1", "score": 0.9}, {"id": "r2", "score": 1},
                            {"id": "r3", "score": 1}]}), {"r1": "scored more than once"}),
])
def test_parse_finds_each_bad_id(text: str, expected: dict[str, str]) -> None:
    ok, problems = parse_scores(text, IDS)
    assert problems == expected
    assert set(ok) == set(IDS) - set(expected)  # every id is in exactly one of the two


@pytest.mark.parametrize("text", ["I think the second one is best.", "", '{"verdict": "r2"}', "[1, 2, 3]"])
def test_parse_unparseable(text: str) -> None:
    ok, problems = parse_scores(text, IDS)
    assert ok == {} and set(problems) == {ANSWER, *IDS}
    assert problems[ANSWER] in ("no scores found in the answer", "empty answer")


def test_prompt_holds_rubric_task_and_every_attempt() -> None:
    settings = JudgeSettings(base_url="http://x/v1", model="m", rubric=RUBRIC, max_chars=120)
    long = "word " * 40
    cands = [Candidate("a", [{"role": "system", "content": "SECRET"}, {"role": "user", "content": "2+3?"},
                             {"role": "assistant", "content": None, "tool_calls": [
                                 {"function": {"name": "add", "arguments": '{"a":2,"b":3}'}}]},
                             {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"}]),
             Candidate("b", [{"role": "assistant", "content": [{"type": "text", "text": long + "END"}]}])]
    system, user = build_messages(settings, {"question": "2+3?"}, cands)
    assert system["role"] == "system" and "JSON" in system["content"]
    text = user["content"]
    assert RUBRIC in text and '{"question": "2+3?"}' in text and "SECRET" not in text
    assert '[assistant calls tool] add({"a":2,"b":3})' in text and "[tool] 5" in text
    assert "### Attempt r1" in text and "### Attempt r2" in text and text.endswith("Answer with the JSON only.")
    assert len(render_conversation(cands[1].messages, 120)) == 121 and "END" in text and "word " * 30 not in text  # cut from the front


def test_settings_and_combine() -> None:
    with pytest.raises(ValueError, match="rubric"):
        JudgeSettings(base_url="http://x/v1", model="m", rubric="  ")
    with pytest.raises(ValueError, match="retries"):
        JudgeSettings(base_url="http://x/v1", model="m", rubric=RUBRIC, retries=-1)
    assert combine(1.0, 0.5, agent_weight=0.5, judge_weight=1.0) == 1.0
    assert combine(None, 0.25, agent_weight=1.0, judge_weight=2.0) == 0.5
    assert math.isclose(combine(0.2, 0.7, agent_weight=0.0, judge_weight=1.0), 0.7)


def _cands(n: int = 3) -> list[Candidate]:
    return [Candidate(f"roll-{i}", [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": str(i)}])
            for i in range(n)]


def test_judge_group_good_answer(tmp_path: Path) -> None:
    with scripted_judge(tmp_path, [{"content": _answer(r1=0.2, r2=1.0, r3=0.0)}]) as (url, log):
        seen = []
        s = JudgeSettings(base_url=url, model="judge-m", rubric=RUBRIC, api_key="k", headers={"X-Agent-Name": "j"})
        j = judge_group(s, "2+3?", _cands(), on_attempt=seen.append)
        (body,) = read_log(log)
    assert [(x.rollout_id, x.score, x.error) for x in j.scores] == [
        ("roll-0", 0.2, None), ("roll-1", 1.0, None), ("roll-2", 0.0, None)]
    assert j.scores[0].explanation == "why r1" and j.failed == [] and len(seen) == len(j.attempts) == 1
    assert body["model"] == "judge-m" and body["temperature"] == 0.0 and body["messages"] == j.attempts[0].messages


def test_judge_group_retries_bad_answers_then_succeeds(tmp_path: Path) -> None:
    answers = [{"status": 500}, {"content": "The second is best."}, {"content": _answer(r1=0.5, r2=2, r3=0)},
               {"content": _answer(r1=0.1, r2=0.9, r3=0.0)}]
    with scripted_judge(tmp_path, answers) as (url, log):
        j = judge_group(JudgeSettings(base_url=url, model="m", rubric=RUBRIC, retries=3), None, _cands())
        bodies = read_log(log)
    assert [x.score for x in j.scores] == [0.1, 0.9, 0.0]
    assert len(j.attempts) == len(bodies) == 4
    assert j.attempts[0].call_error and "HTTP 500" in j.attempts[0].call_error
    # each bad answer goes back to the judge with what was wrong with it
    last = bodies[-1]["messages"]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert "no scores found" in last[3]["content"] and "r2: score 2 is out of range" in last[5]["content"]


def test_judge_group_gives_a_clear_error_per_rollout_never_a_zero(tmp_path: Path) -> None:
    answers = [{"content": _answer(r1=0.5, r2=7)}, {"content": _answer(r1=0.4, r3=0.6, r2="n/a")}]
    with scripted_judge(tmp_path, answers) as (url, _):
        j = judge_group(JudgeSettings(base_url=url, model="m", rubric=RUBRIC, retries=2), None, _cands())
    assert len(j.attempts) == 3  # the last answer repeats: every attempt used
    # scores from one answer only: the first with the most valid ids (r1 and r3 valid)
    assert [x.score for x in j.scores] == [0.4, None, 0.6]
    (bad,) = j.failed
    assert bad.rollout_id == "roll-1" and bad.error == "judge failed after 3 attempt(s): score is not a number: 'n/a'"
    with pytest.raises(JudgeError, match="roll-1: judge failed after 3"):
        _ = bad.value


def test_judge_group_unreachable(tmp_path: Path) -> None:
    from tests.procs import free_port

    s = JudgeSettings(base_url=f"http://127.0.0.1:{free_port()}/v1", model="m", rubric=RUBRIC, retries=1)
    j = judge_group(s, None, _cands(2))
    assert len(j.attempts) == 2 and [x.score for x in j.scores] == [None, None]
    assert all("judge unreachable" in (x.error or "") for x in j.scores), j.scores
