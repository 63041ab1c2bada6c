"""A Responses request body → the chat call it stands for (``ParsedRequest``), validated by hand like the
chat routes (400 in OpenAI's shape naming the parameter).

What is taken: ``input`` (``items``), ``instructions`` (a system message first; not carried over by
``previous_response_id``, as OpenAI does), function ``tools`` and ``tool_choice``, ``max_output_tokens``,
``temperature``, ``top_p``, ``stream``, ``store``, ``previous_response_id``; ``metadata``, ``user``,
``parallel_tool_calls``, ``reasoning``, ``truncation`` and the like are kept on the stored response but do
not change the call. Refused with a 400, rather than ignored: hosted tools, structured output formats,
``background``, ``conversation``, prompt templates, ``top_logprobs``, ``max_tool_calls``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tracegym.gateway.openai_errors import bad_request
from tracegym.gateway.proxy.responses.items import InputItems, check_tool_outputs, input_items
from tracegym.gateway.proxy.upstream.base import SamplingParams
from tracegym.gateway.proxy.validation import ParsedRequest, _boolean, _get, _integer, _model, _number

_INCLUDE_OK = frozenset({"reasoning.encrypted_content"})
"""``include`` values accepted: reasoning comes back in plain text anyway (no encrypted content)."""
_REFUSED = ("background", "conversation", "prompt", "max_tool_calls")


@dataclass(slots=True)
class ResponsesRequest:
    body: dict[str, Any]
    model: str
    input: InputItems
    instructions: str | None
    tools: list[dict[str, Any]] | None
    """Chat-shaped: ``{"type": "function", "function": {...}}``."""
    tool_choice: Any
    sampling: SamplingParams
    stream: bool
    previous_response_id: str | None


def _tools(body: dict) -> list[dict[str, Any]] | None:
    tools = _get(body, "tools", list, "a list")
    out = []
    for i, t in enumerate(tools or []):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{i}] has type {kind!r}; this gateway runs function tools only "
                              "(hosted tools need OpenAI's servers)", f"tools[{i}].type")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_request(f"tools[{i}].name must be a non-empty string", f"tools[{i}].name")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(body: dict, tools: list | None) -> Any:
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none", "required"):
        chat = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        chat = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
                          "'name': ...}", "tool_choice")
    if chat not in (None, "none") and not tools:
        raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
    return chat


def _check_unsupported(body: dict) -> None:
    for key in _REFUSED:
        if body.get(key) not in (None, False):
            raise bad_request(f"'{key}' is not supported by this gateway", key)
    fmt = (_get(body, "text", dict, "an object") or {}).get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad_request("only text.format {'type': 'text'} is supported (no constrained decoding)",
                          "text.format")
    include = _get(body, "include", list, "a list") or []
    if bad := [x for x in include if x not in _INCLUDE_OK]:
        raise bad_request(f"'include' values {bad} are not supported; accepted: {sorted(_INCLUDE_OK)}",
                          "include")
    if _integer(body, "top_logprobs", 0, 20):
        raise bad_request("'top_logprobs' is not supported on /v1/responses", "top_logprobs")
    if (instructions := body.get("instructions")) is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string", "instructions")


def parse_responses(body: dict[str, Any]) -> ResponsesRequest:
    model = _model(body)
    if "input" not in body:
        raise bad_request("'input' is required", "input")
    _check_unsupported(body)
    tools = _tools(body)
    previous = _get(body, "previous_response_id", str, "a string")
    _boolean(body, "store")  # type-checked; False keeps the response out of GET and chaining
    return ResponsesRequest(
        body=body, model=model, input=input_items(body["input"]), instructions=body.get("instructions") or None,
        tools=tools, tool_choice=_tool_choice(body, tools),
        sampling=SamplingParams(max_tokens=_integer(body, "max_output_tokens", 1),
                                temperature=_number(body, "temperature", 0.0, 2.0),
                                top_p=_number(body, "top_p", 0.0, 1.0)),
        stream=_boolean(body, "stream"), previous_response_id=previous or None,
    )


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> ParsedRequest:
    """The chat call: instructions, the previous response's conversation (``history``), then the input."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages = [*system, *history, *req.input.messages]
    check_tool_outputs(messages)
    chat: dict[str, Any] = {"model": req.model, "messages": messages}
    for key, value in (("tools", req.tools), ("tool_choice", req.tool_choice),
                       ("max_tokens", req.sampling.max_tokens), ("temperature", req.sampling.temperature),
                       ("top_p", req.sampling.top_p)):
        if value is not None:
            chat[key] = value
    return ParsedRequest(
        operation="chat", api="responses", body=chat, model=req.model, sampling=req.sampling,
        stream=req.stream, messages=messages, tools=req.tools, tool_choice=req.tool_choice,
        source={"api": "responses", "request": req.body},
    )
