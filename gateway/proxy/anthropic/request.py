"""A Messages request body → the chat call it stands for (``ParsedRequest``), validated by hand (400s,
answered in Anthropic's shape by the routes).

Translation: ``system`` → a system message first; a user message's ``text`` blocks → a user message and
each ``tool_result`` → a ``tool`` message (in block order); an assistant message → one assistant message
whose content is its ``thinking`` and ``text`` in the canonical form of ``prompt/reasoning.py`` and whose
``tool_calls`` are its ``tool_use`` blocks, which is exactly the message the gateway recorded for that
reply (``reply_parts.Turn.chat_message``), so prefix reuse continues its sampled ids. ``tools`` (``input_schema``)
→ function tools; ``tool_choice`` auto/any/tool/none → auto/required/named/none; ``stop_sequences`` → stop.

Taken but without effect on the call: ``metadata``, ``thinking`` (the model's template decides whether
it reasons), ``service_tier``, ``disable_parallel_tool_use``, ``cache_control`` marks. Refused (400):
``top_k``, image/document blocks, server tools, ``redacted_thinking``, a final assistant message (prefill),
``mcp_servers``, ``container``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tracegym.gateway.openai_errors import bad_request
from tracegym.gateway.proxy.prompt.reasoning import join_reasoning
from tracegym.gateway.proxy.upstream.base import SamplingParams
from tracegym.gateway.proxy.validation import ParsedRequest, _boolean, _get, _integer, _model, _number

_REFUSED = ("top_k", "mcp_servers", "container")


@dataclass(slots=True)
class MessagesRequest:
    body: dict[str, Any]
    model: str
    messages: list[dict[str, Any]]
    """Chat messages, the system prompt first."""
    tools: list[dict[str, Any]] | None
    tool_choice: Any
    sampling: SamplingParams
    stream: bool


def _str(block: dict, key: str, where: str) -> str:
    v = block.get(key)
    if not isinstance(v, str):
        raise bad_request(f"{where}.{key}: Input should be a valid string", f"{where}.{key}")
    return v


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise bad_request(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
    return content


def _unsupported(kind: Any, where: str, allowed: str) -> Exception:
    return bad_request(f"{where}.type: unsupported content block type {kind!r}; this gateway serves text "
                       f"models and takes {allowed} blocks here", f"{where}.type")


def _system(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value or None
    blocks = _blocks(value, "system")
    for j, b in enumerate(blocks):
        if b.get("type") != "text":
            raise _unsupported(b.get("type"), f"system.{j}", "text")
    return "\n".join(_str(b, "text", f"system.{j}") for j, b in enumerate(blocks))


def _tool_result_text(block: dict, where: str) -> str:
    content = block.get("content")
    if content is None:
        return ""
    parts = _blocks(content, where)
    for j, b in enumerate(parts):
        if b.get("type") != "text":
            raise _unsupported(b.get("type"), f"{where}.content.{j}", "text")
    return "\n".join(_str(b, "text", f"{where}.content.{j}") for j, b in enumerate(parts))


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    reasoning: str | None = None
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        kind, at = b.get("type"), f"{where}.content.{j}"
        if kind == "text":
            texts.append(_str(b, "text", at))
        elif kind == "thinking":
            reasoning = (reasoning or "") + _str(b, "thinking", at)
        elif kind == "tool_use":
            args = b.get("input")
            if not isinstance(args, dict):
                raise bad_request(f"{at}.input: Input should be a valid dictionary", f"{at}.input")
            calls.append({"id": _str(b, "id", at), "type": "function", "function": {
                "name": _str(b, "name", at), "arguments": json.dumps(args, ensure_ascii=False)}})
        else:
            raise _unsupported(kind, at, "text, thinking and tool_use")
    # Text blocks of one reply are concatenated: a streamed reply may arrive as several of them.
    msg: dict[str, Any] = {"role": "assistant", "content": join_reasoning(reasoning, "".join(texts)) or None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(blocks: list[dict[str, Any]], where: str, tool_uses: set[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, b in enumerate(blocks):
        kind, at = b.get("type"), f"{where}.content.{j}"
        if kind == "text":
            texts.append(_str(b, "text", at))
        elif kind == "tool_result":
            tool_use_id = _str(b, "tool_use_id", at)
            if tool_use_id not in tool_uses:
                raise bad_request(f"{at}: unexpected `tool_use_id` found in `tool_result` blocks: {tool_use_id}. "
                                  "Each `tool_result` block must have a corresponding `tool_use` block in the "
                                  "previous message.", at)
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": tool_use_id, "content": _tool_result_text(b, at)})
        else:
            raise _unsupported(kind, at, "text and tool_result")
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: Field required (a non-empty list)", "messages")
    system = _system(body.get("system"))
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    tool_uses: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where}.role: Input should be 'user' or 'assistant'", f"{where}.role")
        blocks = _blocks(m.get("content"), where)
        if m["role"] == "assistant":
            msg = _assistant(blocks, where)
            tool_uses = {c["id"] for c in msg.get("tool_calls") or ()}
            out.append(msg)
        else:
            out += _user(blocks, where, tool_uses)
            tool_uses = set()
    if messages[-1].get("role") == "assistant":
        raise bad_request("messages: a final assistant message (prefill) is not supported by this gateway; "
                          "end with a user message", "messages")
    return out


def _tools(body: dict) -> list[dict[str, Any]] | None:
    tools = _get(body, "tools", list, "a list")
    out = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict):
            raise bad_request(f"tools.{i}: Input should be an object", f"tools.{i}")
        if t.get("type") not in (None, "custom"):
            raise bad_request(f"tools.{i}.type: server tool {t.get('type')!r} is not supported; this gateway "
                              "runs client tools (name, description, input_schema) only", f"tools.{i}.type")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_request(f"tools.{i}.name: Field required", f"tools.{i}.name")
        if not isinstance(t.get("input_schema"), dict):
            raise bad_request(f"tools.{i}.input_schema: Field required (an object)", f"tools.{i}.input_schema")
        fn = {"name": t["name"], "description": t.get("description"), "parameters": t["input_schema"]}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out or None


def _tool_choice(body: dict, tools: list | None) -> Any:
    choice = _get(body, "tool_choice", dict, "an object")
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice.name: Field required", "tool_choice.name")
        chat: Any = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in ("auto", "any", "none"):
        chat = {"auto": "auto", "any": "required", "none": "none"}[kind]
    else:
        raise bad_request("tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'", "tool_choice.type")
    if chat != "none" and not tools:
        raise bad_request("tool_choice may only be specified while providing tools", "tool_choice")
    return chat


def _stop_sequences(body: dict) -> list[str]:
    stops = _get(body, "stop_sequences", list, "a list") or []
    if not all(isinstance(s, str) for s in stops):
        raise bad_request("stop_sequences: Input should be a list of strings", "stop_sequences")
    return [s for s in stops if s]


def parse_messages(body: dict[str, Any], *, count_only: bool = False) -> MessagesRequest:
    """``count_only``: a ``count_tokens`` body (no ``max_tokens``, no sampling)."""
    model = _model(body)
    for key in _REFUSED:
        if body.get(key) is not None:
            raise bad_request(f"{key}: not supported by this gateway", key)
    max_tokens = None
    if not count_only:
        if body.get("max_tokens") is None:
            raise bad_request("max_tokens: Field required", "max_tokens")
        max_tokens = _integer(body, "max_tokens", 1)
    tools = _tools(body)
    return MessagesRequest(
        body=body, model=model, messages=chat_messages(body), tools=tools, tool_choice=_tool_choice(body, tools),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=_number(body, "temperature", 0.0, 1.0),
                                top_p=_number(body, "top_p", 0.0, 1.0), stop=_stop_sequences(body)),
        stream=_boolean(body, "stream"),
    )


def chat_request(req: MessagesRequest) -> ParsedRequest:
    chat: dict[str, Any] = {"model": req.model, "messages": req.messages}
    for key, value in (("tools", req.tools), ("tool_choice", req.tool_choice),
                       ("max_tokens", req.sampling.max_tokens), ("temperature", req.sampling.temperature),
                       ("top_p", req.sampling.top_p), ("stop", req.sampling.stop or None)):
        if value is not None:
            chat[key] = value
    return ParsedRequest(
        operation="chat", api="messages", body=chat, model=req.model, sampling=req.sampling, stream=req.stream,
        messages=req.messages, tools=req.tools, tool_choice=req.tool_choice,
        source={"api": "messages", "request": req.body},
    )
