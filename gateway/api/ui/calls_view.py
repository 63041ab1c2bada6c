"""A rollout's calls as the inspector lists them: API, agent, latency, weight version, drift, tool-parse
status, error, and the messages each call added to the conversation (the earlier ones are the previous
call's, and are counted instead of repeated)."""

from __future__ import annotations

from typing import Any

REQUEST = "tracegym.request"
OPERATION_API = {"chat": "chat.completions", "text_completion": "completions"}
"""The API a call came in on, when the span does not name it (``tracegym.api``)."""
EXCLUSION_REASONS = {
    "agent": "its agent is not selected for training (agent_match / agents)",
    "no_ids": "the upstream returned no token ids for it",
    "error": "the call ended in an error",
    "retokenized": "its ids were re-derived from text or it has no engine logprobs (not on-policy)",
}
TOOL_OPEN = "<tool_call>"


def request_messages(request: dict[str, Any]) -> list[Any]:
    """The conversation a request sent: chat ``messages`` (or a Responses-style ``input`` list)."""
    for key in ("messages", "input"):
        value = request.get(key)
        if isinstance(value, list):
            return value
    prompt = request.get("prompt")
    return [{"role": "prompt", "content": prompt}] if prompt is not None else []


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def _same(a: Any, b: Any) -> bool:
    """Two messages alike as the agent sees them (role and text; a reply echoed back by a client may
    gain or lose empty fields)."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return a == b
    return a.get("role") == b.get("role") and _text(a.get("content")) == _text(b.get("content"))


def repeated_prefix(messages: list[Any], earlier: list[Any]) -> int:
    """How many leading ``messages`` repeat ``earlier`` (the previous call's messages and its reply)."""
    n = 0
    for a, b in zip(messages, earlier, strict=False):
        if not _same(a, b):
            break
        n += 1
    return n


def tool_parse_status(request: dict[str, Any], choices: list[dict[str, Any]]) -> str:
    """``parsed`` (the reply carries tool calls), ``failed`` (a ``<tool_call>`` block stayed in the text:
    the model tried and the syntax did not parse), ``none`` (tools offered, none called) or ``no_tools``."""
    for ch in choices:
        msg = ch.get("message") or {}
        if msg.get("tool_calls"):
            return "parsed"
    for ch in choices:
        msg = ch.get("message") or {}
        if TOOL_OPEN in _text(msg.get("content")) or TOOL_OPEN in _text(msg.get("text")):
            return "failed"
    return "none" if request.get("tools") else "no_tools"


def _tool_names(request: dict[str, Any]) -> list[str]:
    names = []
    for t in request.get("tools") or []:
        fn = t.get("function") if isinstance(t, dict) else None
        name = (fn or t).get("name") if isinstance(fn or t, dict) else None
        if isinstance(name, str):
            names.append(name)
    return names


def call_rows(spans: list[dict[str, Any]], excluded: list[dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    """``(calls, other_spans)`` of a rollout's spans in start order: its LLM calls as the inspector
    lists them, and the agent's own (OTLP) spans."""
    reasons: dict[str, list[dict]] = {}
    for e in excluded:
        reasons.setdefault(e["call_id"], []).append(e)
    calls: list[dict] = []
    others: list[dict] = []
    last_by_agent: dict[Any, list[Any]] = {}
    for span in spans:
        a = span["attributes"] or {}
        latency = (span["end_time_ns"] - span["start_time_ns"]) / 1e9
        if span.get("choices") is None:
            others.append({"name": span["name"], "span_id": span["span_id"], "status": span["status"],
                           "start_time_ns": span["start_time_ns"], "duration_s": latency,
                           "attributes": a})
            continue
        request = a.get(REQUEST) if isinstance(a.get(REQUEST), dict) else {}
        messages = request_messages(request)
        agent = a.get("tracegym.agent_name")
        shown_from = repeated_prefix(messages, last_by_agent.get(agent, []))
        choices = span["choices"]
        replies = [ch.get("message") for ch in choices]
        last_by_agent[agent] = [*messages, replies[0]] if replies else messages
        operation = a.get("gen_ai.operation.name")
        call_id = span["call_id"]
        calls.append({
            "index": len(calls), "call_id": call_id, "span_id": span["span_id"],
            "api": a.get("tracegym.api") or OPERATION_API.get(operation, operation),
            "model": a.get("gen_ai.request.model"), "agent_name": agent,
            "start_time_ns": span["start_time_ns"], "latency_s": latency,
            "ttft_s": a.get("tracegym.time_to_first_token_s"),
            "weight_version": a.get("tracegym.weight_version"), "drift": a.get("tracegym.drift", "none"),
            "prefix_len": a.get("tracegym.prefix_len", 0), "retokenized": a.get("tracegym.retokenized", False),
            "status": span["status"], "error": a.get("tracegym.error") or span.get("status_message"),
            "tool_parse": a.get("tracegym.tool_parse") or tool_parse_status(request, choices),
            "input_tokens": a.get("gen_ai.usage.input_tokens"), "output_tokens": a.get("gen_ai.usage.output_tokens"),
            "tools": _tool_names(request), "messages": messages[shown_from:], "messages_from": shown_from,
            "messages_total": len(messages),
            "replies": [{"index": ch["index"], "message": ch.get("message"), "finish_reason": ch.get("finish_reason"),
                         "output_tokens": len(ch.get("output_ids") or [])} for ch in choices],
            "excluded": [{"choice_index": e["choice_index"], "reason": e["reason"],
                          "explanation": EXCLUSION_REASONS.get(e["reason"], e["reason"])}
                         for e in reasons.get(call_id, [])],
        })
    return calls, others
