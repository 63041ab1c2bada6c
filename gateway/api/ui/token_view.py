"""A rollout's trajectory as the inspector's token view: every sequence's tokens with their text, loss
mask and engine logprob, the ranges each call contributed (the prompt, the context added before a call
— tool results, user turns —, the sampled output), the weight version of each sampled range, and a marker
where each call joined the sequence with its drift status (``clean``: continued exactly; ``realigned``;
``forked``; ``none``: rendered whole).

Trainer logprobs: a sequence shows the trainer's logprob of each token when the rollout has an event
``tracegym.trainer_logprobs`` with value ``{"sequence": i, "logprobs": [...]}``, the list as long as the
sequence (null where not computed) or as its sampled tokens (in order). The last such event of a sequence
counts.
"""

from __future__ import annotations

import math
from typing import Any

from tracegym.gateway.api.ui.calls_view import REQUEST, repeated_prefix, request_messages
from tracegym.gateway.traces.token_calls import TokenCall, count
from tracegym.types import Trajectory

TRAINER_LOGPROBS = "tracegym.trainer_logprobs"


def _floats(values: Any) -> list[float | None]:
    return [None if (v is None or (isinstance(v, float) and math.isnan(v))) else float(v) for v in values]


def trainer_logprobs(events: list[dict[str, Any]]) -> dict[int, list[Any]]:
    """``{sequence index: logprobs}`` from the rollout's ``tracegym.trainer_logprobs`` events."""
    out: dict[int, list[Any]] = {}
    for e in events:
        v = e.get("value")
        if e.get("name") == TRAINER_LOGPROBS and isinstance(v, dict) and isinstance(v.get("logprobs"), list) \
                and isinstance(v.get("sequence"), int):
            out[v["sequence"]] = v["logprobs"]
    return out


def _aligned(values: list[Any] | None, mask: list[int]) -> list[float | None] | None:
    """Trainer logprobs on the sequence's positions (see the module docstring); None when absent or of
    neither length."""
    if values is None:
        return None
    if len(values) == len(mask):
        return _floats(values)
    sampled = [i for i, m in enumerate(mask) if m]
    if len(values) != len(sampled):
        return None
    out: list[float | None] = [None] * len(mask)
    for i, v in zip(sampled, _floats(values), strict=True):
        out[i] = v
    return out


def _context_kind(span: dict[str, Any] | None, previous: dict[str, Any] | None) -> str:
    """What the tokens between the previous call's output and this call's are: ``tool`` (tool results),
    ``user`` (user turns), else ``context`` (a mix, or only template tokens)."""
    if span is None or previous is None:
        return "context"
    req = span["attributes"].get(REQUEST) or {}
    prev_req = previous["attributes"].get(REQUEST) or {}
    earlier = [*request_messages(prev_req), (previous.get("choices") or [{}])[0].get("message")]
    messages = request_messages(req)
    roles = {m.get("role") for m in messages[repeated_prefix(messages, earlier):] if isinstance(m, dict)}
    roles.discard("assistant")
    if roles == {"tool"}:
        return "tool"
    if roles == {"user"}:
        return "user"
    return "context"


def _choice_span(span: dict[str, Any] | None, index: int) -> dict[str, Any]:
    for ch in (span or {}).get("choices") or []:
        if ch.get("index") == index:
            return ch
    return {}


def sequence_view(i: int, seq: Any, calls: dict[str, tuple[int, TokenCall]], spans: dict[str, dict],
                  texts: list[str] | None, trainer: list[Any] | None) -> dict[str, Any]:
    """One sequence of the view (``calls``: ``{call_id: (index in the rollout, TokenCall)}``;
    ``spans``: the decoded spans by call id)."""
    ids, mask, lps = seq.token_ids, seq.loss_mask, _floats(seq.logprobs)  # lists: the view is JSON
    segments: list[dict[str, Any]] = []
    versions: list[dict[str, Any]] = []
    markers: list[dict[str, Any]] = []
    prev_end, prev_span = 0, None
    for call_id, choice_index in zip(seq.call_ids, seq.choice_indices, strict=True):
        pos, call = calls[call_id]
        span = spans.get(call_id)
        choice = next(c for c in call.choices if c.index == choice_index)
        start = count(call.prompt)
        end = start + count(choice.output)
        if start > prev_end:
            kind = "prompt" if prev_span is None else _context_kind(span, prev_span)
            segments.append({"start": prev_end, "end": start, "kind": kind, "call_index": pos, "call_id": call_id})
        drift = (span or {}).get("attributes", {}).get("tracegym.drift", "none")
        markers.append({"pos": prev_end, "call_index": pos, "call_id": call_id, "drift": drift})
        segments.append({"start": start, "end": end, "kind": "sampled", "call_index": pos, "call_id": call_id})
        recorded = _choice_span(span, choice_index).get("weight_versions") or []
        if recorded:
            versions += [{"start": start + s, "end": start + e, "version": v, "call_index": pos}
                         for v, s, e in recorded]
        elif end > start:
            versions.append({"start": start, "end": end, "version": call.weight_version, "call_index": pos})
        prev_end, prev_span = end, span
    return {
        "index": i, "agent_name": seq.agent_name, "reward": seq.reward, "retokenized": seq.retokenized,
        "weight_versions": seq.weight_versions, "call_ids": seq.call_ids, "step_rewards": seq.step_rewards,
        "n_tokens": len(ids), "n_sampled": sum(mask), "token_ids": ids, "text": texts, "loss_mask": mask,
        "logprobs": lps, "trainer_logprobs": _aligned(trainer, mask),
        "segments": segments, "versions": versions, "markers": markers,
    }


def trajectory_view(traj: Trajectory, calls: list[TokenCall], spans: list[dict[str, Any]], texts_of: Any,
                    trainer: dict[int, list[Any]], mode: str) -> dict[str, Any]:
    """The token view of an assembled trajectory (``texts_of(ids)``: token texts, or None)."""
    by_id = {c.call_id: (i, c) for i, c in enumerate(calls)}
    span_by_call = {s["call_id"]: s for s in spans if s.get("choices") is not None}
    seqs = []
    for i, seq in enumerate(traj.sequences):
        texts = texts_of(seq.token_ids)
        seqs.append(sequence_view(i, seq, by_id, span_by_call, texts, trainer.get(i)))
    excluded = [{**e, "call_index": by_id[e["call_id"]][0] if e["call_id"] in by_id else None}
                for e in traj.excluded]
    return {"mode": mode, "reward": traj.reward, "sequences": seqs, "excluded": excluded}
