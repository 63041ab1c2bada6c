"""A seeded generator of chat conversations for the model-family conformance tests, and, for each family,
the two forms a conversation is written in: what an OpenAI client sends (``openai``) and what the family's
official template documents as its input (``native``, written here from the model cards, not by the
gateway's code), plus the text a model of the family samples for a turn (``sampled``)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "number"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["query"]}}},
]
TEXTS = ["Hello!", "What is 2+3?", "Résumé: café, naïve — ok?", "中文 and emoji 🎉 mixed",
         "line one\nline two\n\nline four", "", "  padded  ", "a" * 300, "quote \" and backslash \\ here",
         "tabs\tand <b>markup</b>", "Thanks.", "Καλημέρα", "ok"]


@dataclass
class Call:
    id: str
    name: str
    args: dict[str, Any]


@dataclass
class Turn:
    role: str  # system | user | assistant | tool
    text: str = ""
    reasoning: str | None = None
    calls: list[Call] = field(default_factory=list)
    call_id: str = ""
    name: str = ""  # the tool's name, for a tool result


def _args(rng: random.Random, name: str) -> dict[str, Any]:
    if name == "get_weather":
        out: dict[str, Any] = {"city": rng.choice(["Paris", "São Paulo", "東京", "New York"])}
        if rng.random() < 0.5:
            out["unit"] = rng.choice(["c", "f"])
        return out
    if name == "add":
        return {"a": rng.randint(-5, 99), "b": rng.choice([1, 2.5, -3])}
    out = {"query": rng.choice(["llamas", "naïve bayes", "熊猫"])}
    if rng.random() < 0.5:
        out["tags"] = rng.sample(["x", "y", "ü"], rng.randint(0, 3))
    return out


def conversation(seed: int, *, parallel: bool, reasoning: bool, tools: bool) -> tuple[list[Turn], bool]:
    """Turns ending with a user or tool turn, and whether tools are offered."""
    rng = random.Random(seed)
    turns: list[Turn] = []
    offered = tools and rng.random() < 0.7
    if rng.random() < 0.6:
        turns.append(Turn("system", rng.choice(["You are helpful.", "Be brief. ✓", "", "Answer in French."])))
    n = 0
    for _ in range(rng.randint(1, 6)):
        turns.append(Turn("user", rng.choice([t for t in TEXTS if t]) if rng.random() < 0.9 else ""))
        while True:
            think = rng.choice(["plan: call it", "", "π ≈ 3.14\nso"]) if reasoning and rng.random() < 0.5 else None
            if offered and rng.random() < 0.5:
                k = rng.randint(2, 3) if parallel and rng.random() < 0.4 else 1
                calls = []
                for _ in range(k):
                    n += 1
                    name = rng.choice(TOOLS)["function"]["name"]
                    calls.append(Call(f"call_{seed}_{n}", name, _args(rng, name)))
                turns.append(Turn("assistant", "", think, calls))
                for c in calls:
                    turns.append(Turn("tool", rng.choice(["42", "sunny, 21°C", '{"ok": true}', "", "ошибка"]),
                                      call_id=c.id, name=c.name))
                if rng.random() < 0.3:
                    break  # ends on tool results: the model answers next
                continue
            turns.append(Turn("assistant", rng.choice([t for t in TEXTS if t.strip() == t and t]), think))
            break
    if turns[-1].role == "assistant":
        turns.append(Turn("user", rng.choice(TEXTS[:5])))
    return turns, offered


# ------------------------------------------------------------------------------------------ OpenAI form


def openai(turns: list[Turn]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for t in turns:
        if t.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": t.text or None}
            if t.reasoning is not None:
                msg["reasoning_content"] = t.reasoning
            if t.calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.name, "arguments": json.dumps(c.args, ensure_ascii=False)}} for c in t.calls]
            out.append(msg)
        elif t.role == "tool":
            out.append({"role": "tool", "tool_call_id": t.call_id, "content": t.text})
        else:
            out.append({"role": t.role, "content": t.text})
    return out


# ------------------------------------------------------------------------------------------ native forms


def _hermes_call(c: Call) -> str:
    return "<tool_call>" + json.dumps({"name": c.name, "arguments": c.args}, ensure_ascii=False) + "</tool_call>"


def _hermes_section(tools: list[dict[str, Any]]) -> str:
    sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{sigs}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags, one call per tag:\n"
            '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>')


def _with_system(msgs: list[dict[str, Any]], section: str) -> list[dict[str, Any]]:
    if msgs and msgs[0]["role"] == "system":
        first = msgs[0]["content"]
        return [{"role": "system", "content": f"{first}\n\n{section}" if first else section}, *msgs[1:]]
    return [{"role": "system", "content": section}, *msgs]


def _think(reasoning: str | None, text: str) -> str:
    return text if reasoning is None else f"<think>\n{reasoning}\n</think>\n\n{text}"


def native(family: str, turns: list[Turn], offered: bool) -> tuple[list[dict[str, Any]], list | None]:
    """``(messages, tools)`` for ``apply_chat_template`` with the family's official template."""
    msgs: list[dict[str, Any]] = []
    for t in turns:
        if t.role == "user" and family == "gemma3" and msgs and msgs[-1].get("_tool"):
            msgs[-1]["content"] += "\n" + t.text  # roles must alternate: it joins the tool results' turn
        elif t.role in ("system", "user"):
            msgs.append({"role": t.role, "content": t.text})
        elif t.role == "tool":
            if family in ("chatml", "gemma3"):
                body = f"<tool_response>\n{t.text}\n</tool_response>"
                prev = msgs[-1] if msgs else None
                if family == "gemma3" and prev is not None and prev.get("_tool"):
                    prev["content"] += "\n" + body
                else:
                    msgs.append({"role": "user" if family == "gemma3" else "tool", "content": body, "_tool": True})
            else:
                msgs.append({"role": "tool", "tool_call_id": t.call_id, "content": t.text})
        elif family in ("chatml", "gemma3"):
            parts = [_think(t.reasoning, t.text)] if (t.text or t.reasoning is not None) else []
            msgs.append({"role": "assistant", "content": "\n".join(parts + [_hermes_call(c) for c in t.calls])})
        elif family == "qwen3":
            m: dict[str, Any] = {"role": "assistant", "content": t.text}
            if t.reasoning is not None:
                m["reasoning_content"] = t.reasoning
            if t.calls:
                m["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.args}}
                                   for c in t.calls]
            msgs.append(m)
        elif family == "llama3":
            if t.calls:
                for c in t.calls:  # the template takes one call per message
                    msgs.append({"role": "assistant", "content": "", "tool_calls": [
                        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.args}}]})
            else:
                msgs.append({"role": "assistant", "content": t.text})
        elif family == "deepseek_v3":
            if t.calls:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": c.id, "type": "function", "function": {
                        "name": c.name, "arguments": json.dumps(c.args, ensure_ascii=False)}} for c in t.calls]})
            else:
                msgs.append({"role": "assistant", "content": t.text})
        elif family == "gpt_oss":
            m = {"role": "assistant", "content": t.text}
            if t.reasoning is not None:
                m["thinking"] = t.reasoning
            if t.calls:
                (c,) = t.calls
                m["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.args}}]
            msgs.append(m)
    for m in msgs:
        m.pop("_tool", None)
    if not offered:
        return msgs, None
    if family in ("chatml", "gemma3"):
        return _with_system(msgs, _hermes_section(TOOLS)), None
    if family == "deepseek_v3":
        sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in TOOLS)
        section = ("## Tools\n\nYou have access to the following functions:\n\n" + sigs + "\n\n"
                   "To call a function, reply with:\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n"
                   "```json\n{ARGUMENTS}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
        return _with_system(msgs, section), None
    return msgs, TOOLS


# ---------------------------------------------------------------------------------------- sampled text


def sampled(family: str, text: str, calls: list[Call], reasoning: str | None = None) -> str:
    """The reply a model of ``family`` writes for a turn (before its stop token)."""
    args = [json.dumps(c.args, ensure_ascii=False) for c in calls]
    if family in ("chatml", "gemma3"):
        return "\n".join(([_think(reasoning, text)] if text or reasoning is not None else [])
                         + [_hermes_call(c) for c in calls])
    if family == "qwen3":
        body = "\n".join(([text] if text else []) + [f'<tool_call>\n{{"name": "{c.name}", "arguments": {a}}}\n</tool_call>'
                                                   for c, a in zip(calls, args, strict=True)])
        return _think(reasoning, body) if reasoning is not None else body
    if family == "llama3":
        return "; ".join(f'{{"name": "{c.name}", "parameters": {a}}}' for c, a in zip(calls, args, strict=True)) or text
    if family == "deepseek_v3":
        if not calls:
            return text
        blocks = "\n".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{c.name}\n```json\n{a}\n```<｜tool▁call▁end｜>"
                           for c, a in zip(calls, args, strict=True))
        return f"{text}<｜tool▁calls▁begin｜>{blocks}<｜tool▁calls▁end｜>"
    if family == "gpt_oss":
        out = f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant" if reasoning is not None else ""
        if calls:
            (c,), (a,) = calls, args
            return out + f" to=functions.{c.name}<|channel|>commentary json<|message|>{a}"
        return out + f"<|channel|>final<|message|>{text}"
    raise ValueError(family)
