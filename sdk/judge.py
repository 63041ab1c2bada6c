"""Group judge rewards: an LLM judge scores the rollouts of one GRPO group relative to each other.

ART's RULER idea, done our way: the judge sees the task once, the group's attempts side by side (each
under a short id, ``r1``, ``r2``, ...) and a rubric the user wrote, and answers one score in [0, 1] per id.
Any OpenAI-compatible ``/chat/completions`` endpoint can judge: the gateway itself, another served model,
or a provider. Pure prompt building and parsing here, plus one retrying HTTP loop on httpx (nothing else:
``import tracegym`` stays light); the trainer's hook (``tracegym.trainer.run.judge``) reads the
rollouts, records the judge's calls as spans and combines the scores with the agent's own rewards.

A judge that answers badly never becomes a silent 0. An answer is checked id by id: unparseable, an id
missing, a score that is not a finite number or is outside [0, 1], an id scored twice. Any problem → the
judge is asked again (the bad answer and what was wrong with it sent back as a follow-up turn), up to
``retries`` more times. Scores are taken from one answer only (relative scores from different answers are
not comparable): the first fully valid one, else the one with the most valid scores; each id that has no
valid score there gets a ``JudgeScore`` with ``score=None`` and ``error`` saying why.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

JUDGE_AGENT = "tracegym-judge"
"""The agent name (``X-Agent-Name``) of judge calls sent through a gateway."""

SYSTEM_PROMPT = (
    "You are a strict judge. Several attempts at the same task are shown, each under an id. Score every "
    "attempt from 0 to 1 by the rubric, comparing the attempts with each other: better attempts get higher "
    "scores, equally good ones equal scores. Answer with JSON only, no other text, in exactly this form: "
    '{"scores": [{"id": "r1", "explanation": "one short sentence", "score": 0.5}, ...]} '
    "with one entry for every id."
)


class JudgeError(RuntimeError):
    """The judge could not score a rollout; the message says why (raised by ``JudgeScore.value``)."""


@dataclass(frozen=True, slots=True)
class JudgeSettings:
    """Where the judge is and how to ask it. ``base_url`` is an OpenAI-compatible base ending in ``/v1``."""

    base_url: str
    model: str
    rubric: str
    api_key: str | None = None
    retries: int = 2
    """Extra attempts after the first when an answer (or the HTTP call) is unusable."""
    temperature: float = 0.0
    max_tokens: int = 512
    timeout_s: float = 300.0
    """Seconds for one judge request (a judge on a CPU engine can take minutes)."""
    max_chars: int = 4000
    """Each attempt's conversation is cut to its last ``max_chars`` characters in the prompt."""
    headers: dict[str, str] = field(default_factory=dict)
    """Extra request headers (e.g. ``X-Agent-Name``)."""

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if not self.rubric.strip():
            raise ValueError("the judge needs a rubric (what makes an attempt good)")


@dataclass(slots=True)
class Candidate:
    """One rollout of the group: its id and the conversation to judge (OpenAI chat messages)."""

    rollout_id: str
    messages: list[dict[str, Any]]


@dataclass(slots=True)
class JudgeScore:
    rollout_id: str
    score: float | None
    """In [0, 1]; None exactly when ``error`` is set."""
    explanation: str = ""
    error: str | None = None

    @property
    def value(self) -> float:
        """The score, or ``JudgeError`` with the reason it has none."""
        if self.score is None:
            raise JudgeError(f"rollout {self.rollout_id}: {self.error}")
        return self.score


@dataclass(slots=True)
class JudgeAttempt:
    """One request to the judge: its messages, the answer's text (None when the call failed), the
    problems found per id (empty when the answer was fully valid), timing."""

    messages: list[dict[str, Any]]
    text: str | None
    problems: dict[str, str]
    start_ns: int
    end_ns: int
    call_error: str | None = None


@dataclass(slots=True)
class GroupJudgement:
    scores: list[JudgeScore]
    """In the order of the candidates."""
    attempts: list[JudgeAttempt]

    @property
    def failed(self) -> list[JudgeScore]:
        return [s for s in self.scores if s.score is None]


def labels(n: int) -> list[str]:
    return [f"r{i + 1}" for i in range(n)]


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def render_conversation(messages: list[dict[str, Any]], max_chars: int) -> str:
    """A conversation as plain text, tool calls and results included (the system prompt left out), cut
    to its last ``max_chars`` characters."""
    lines: list[str] = []
    for m in messages:
        role = m.get("role", "?")
        if role in ("system", "developer"):
            continue
        text = _content_text(m.get("content")).strip()
        if text:
            lines.append(f"[{role}] {text}")
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            lines.append(f"[{role} calls tool] {fn.get('name')}({fn.get('arguments', '')})")
    out = "\n".join(lines) or "(no conversation recorded)"
    return out if len(out) <= max_chars else "…" + out[-max_chars:]


def build_messages(settings: JudgeSettings, task: Any, candidates: list[Candidate]) -> list[dict[str, Any]]:
    """The judge's first request: the system prompt, then the rubric, the task and the attempts."""
    ids = labels(len(candidates))
    task_text = task if isinstance(task, str) else json.dumps(task, ensure_ascii=False, default=str)
    parts = [f"Rubric:\n{settings.rubric.strip()}", f"Task:\n{task_text}"]
    for label, c in zip(ids, candidates, strict=True):
        parts.append(f"### Attempt {label}\n{render_conversation(c.messages, settings.max_chars)}")
    parts.append(f"Score these ids: {', '.join(ids)}. Answer with the JSON only.")
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n\n".join(parts)}]


def retry_message(problems: dict[str, str], ids: list[str]) -> dict[str, Any]:
    what = "; ".join(f"{k}: {v}" for k, v in problems.items())
    return {"role": "user", "content": f"That answer could not be used ({what}). Answer again with the JSON "
            f"only, one entry with a score from 0 to 1 for each of: {', '.join(ids)}."}


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S)
_THINK = re.compile(r"<think>.*?</think>", re.S)
_LINE = re.compile(r"^\W*(r\d+)\W*?\s*[:=]\s*(\S+)", re.M | re.I)
_ID_KEYS = ("id", "trajectory_id", "rollout", "attempt")
ANSWER = "answer"
"""The key of a problem with the answer as a whole (not with one id)."""


def _json_values(text: str) -> list[Any]:
    """JSON objects and arrays found in ``text``: fenced blocks first, then each one starting at a brace."""
    found: list[Any] = []
    dec = json.JSONDecoder()
    for chunk in [*_FENCE.findall(text), text]:
        i = 0
        while (i := _next_open(chunk, i)) >= 0:
            try:
                value, end = dec.raw_decode(chunk, i)
            except json.JSONDecodeError:
                i += 1
                continue
            found.append(value)
            i = end
    return found


def _next_open(text: str, start: int) -> int:
    hits = [p for p in (text.find("{", start), text.find("[", start)) if p >= 0]
    return min(hits) if hits else -1


def _entries(value: Any) -> list[tuple[str, Any, str]] | None:
    """``(id, score, explanation)`` from one JSON value in a known shape, else None."""
    if isinstance(value, dict) and isinstance(value.get("scores"), list | dict):
        value = value["scores"]
    if isinstance(value, dict) and "score" in value and any(k in value for k in _ID_KEYS):
        value = [value]  # one entry on its own (small models write just the first)
    if isinstance(value, dict):  # {"r1": 0.5, ...} or {"r1": {"score": 0.5}}
        if not value or not all(re.fullmatch(r"r\d+", str(k), re.I) for k in value):
            return None
        return [(str(k), v.get("score") if isinstance(v, dict) else v,
                 str(v.get("explanation", "")) if isinstance(v, dict) else "") for k, v in value.items()]
    if isinstance(value, list) and value and all(isinstance(e, dict) for e in value):
        out = []
        for e in value:
            key = next((e[k] for k in _ID_KEYS if k in e), None)
            if key is None:
                return None
            out.append((str(key), e.get("score"), str(e.get("explanation", ""))))
        return out
    return None


def parse_scores(text: str, ids: list[str]) -> tuple[dict[str, tuple[float, str]], dict[str, str]]:
    """The judge's answer → ``({id: (score, explanation)}, {id or "answer": problem})``. Accepts the JSON
    asked for (in a code fence or among other text; ``{"scores": [...]}``, a bare list, or ``{"r1": 0.5}``)
    and, failing JSON, lines ``r1: 0.5``. Every id of ``ids`` ends up in exactly one of the two dicts."""
    text = _THINK.sub("", text or "")
    entries = next((e for v in _json_values(text) if (e := _entries(v)) is not None), None)
    if entries is None:
        entries = [(k, v, "") for k, v in _LINE.findall(text)] or None
    if entries is None:
        problem = "no scores found in the answer" if text.strip() else "empty answer"
        return {}, {ANSWER: problem, **{i: "not scored (unparseable answer)" for i in ids}}
    wanted = {i.lower(): i for i in ids}
    ok: dict[str, tuple[float, str]] = {}
    problems: dict[str, str] = {}
    seen: set[str] = set()
    for key, raw, expl in entries:
        label = wanted.get(key.strip().lower())
        if label is None:
            continue  # an id we did not ask about: ignored
        if label in seen:
            problems[label] = "scored more than once"
            ok.pop(label, None)
            continue
        seen.add(label)
        score, problem = _score(raw)
        if problem:
            problems[label] = problem
        else:
            ok[label] = (score, expl)
    for label in ids:
        if label not in ok and label not in problems:
            problems[label] = "missing from the answer"
    return ok, problems


def _score(raw: Any) -> tuple[float, str | None]:
    if isinstance(raw, bool) or raw is None:
        return 0.0, f"score is not a number: {raw!r}"
    try:
        v = float(str(raw).strip().rstrip(",")) if isinstance(raw, str) else float(raw)
    except (TypeError, ValueError):
        return 0.0, f"score is not a number: {raw!r}"
    if not math.isfinite(v):
        return 0.0, f"score is not finite: {raw!r}"
    if not 0.0 <= v <= 1.0:
        return 0.0, f"score {v:g} is out of range [0, 1]"
    return v, None


def _call(http: httpx.Client, settings: JudgeSettings, messages: list[dict[str, Any]]) -> tuple[str | None, str | None]:
    """One chat completion → ``(text, None)`` or ``(None, error)``."""
    body = {"model": settings.model, "messages": messages, "temperature": settings.temperature,
            "max_tokens": settings.max_tokens}
    headers = {**settings.headers}
    if settings.api_key:
        headers["Authorization"] = f"Bearer {settings.api_key}"
    url = settings.base_url.rstrip("/") + "/chat/completions"
    try:
        r = http.post(url, json=body, headers=headers, timeout=settings.timeout_s)
    except httpx.HTTPError as e:
        return None, f"judge unreachable at {url}: {type(e).__name__}: {e}"
    if r.status_code != 200:
        return None, f"judge answered HTTP {r.status_code}: {r.text[:300]}"
    try:
        choice = r.json()["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None, f"judge answered no chat completion: {r.text[:300]}"
    return _content_text(choice.get("content")), None


def judge_group(
    settings: JudgeSettings,
    task: Any,
    candidates: list[Candidate],
    *,
    http: httpx.Client | None = None,
    on_attempt: Callable[[JudgeAttempt], None] | None = None,
) -> GroupJudgement:
    """Score ``candidates`` (one group's rollouts) relative to each other; see the module docstring for
    retries and errors. ``on_attempt`` sees every request as it finishes (e.g. to record it as a span)."""
    ids = labels(len(candidates))
    messages = build_messages(settings, task, candidates)
    attempts: list[JudgeAttempt] = []
    best: tuple[int, dict[str, tuple[float, str]], dict[str, str]] | None = None
    own = http is None
    client = httpx.Client() if http is None else http
    try:
        for _ in range(settings.retries + 1):
            t0 = time.time_ns()
            text, call_error = _call(client, settings, messages)
            if text is None:
                ok, problems = {}, {ANSWER: call_error or "no answer", **{i: "not scored" for i in ids}}
            else:
                ok, problems = parse_scores(text, ids)
            attempt = JudgeAttempt(list(messages), text, problems, t0, time.time_ns(), call_error)
            attempts.append(attempt)
            if on_attempt is not None:
                on_attempt(attempt)
            if best is None or len(ok) >= best[0]:
                best = (len(ok), ok, problems)
            if not problems:
                break
            if text is not None:  # show the judge its answer and what was wrong with it
                messages = [*messages, {"role": "assistant", "content": text}, retry_message(problems, ids)]
    finally:
        if own:
            client.close()
    assert best is not None
    _, ok, problems = best
    n = len(attempts)
    scores = []
    for label, c in zip(ids, candidates, strict=True):
        if label in ok:
            scores.append(JudgeScore(c.rollout_id, ok[label][0], ok[label][1]))
        else:
            why = problems.get(label, "not scored")
            whole = problems.get(ANSWER)
            detail = f"{why} ({whole})" if whole and whole not in why else why
            scores.append(JudgeScore(c.rollout_id, None, error=f"judge failed after {n} attempt(s): {detail}"))
    return GroupJudgement(scores, attempts)


def combine(agent_reward: float | None, judge_score: float, *, agent_weight: float, judge_weight: float) -> float:
    """The reward the trainer uses: ``agent_weight * agent_reward + judge_weight * judge_score`` (a missing
    agent reward counts as 0, as it does without a judge)."""
    return agent_weight * (agent_reward if agent_reward is not None else 0.0) + judge_weight * judge_score
