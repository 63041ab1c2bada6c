"""Responses items ⇄ chat messages.

Input: a string (one user message) or a list of items. User, system and developer messages become chat
messages; a run of assistant items (a ``reasoning`` item, assistant ``message``s, ``function_call``s: what
one response outputs) becomes one assistant message whose content is the reasoning and text in the
canonical form of ``prompt/reasoning.py`` and whose ``tool_calls`` are the function calls; a
``function_call_output`` becomes a ``tool`` message. So history sent back as items translates to exactly
the message the gateway recorded for that response (``reply_parts.Turn.chat_message``), and prefix reuse
continues its sampled ids.

Output: a ``Turn`` as output items, ids derived from the response id (the same on ``POST`` and ``GET``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tracegym.gateway.openai_errors import bad_request
from tracegym.gateway.proxy.prompt.reasoning import join_reasoning
from tracegym.gateway.proxy.reply_parts import Turn

_USER_ROLES = ("user", "system", "developer")
_ASSISTANT_ITEMS = ("reasoning", "function_call")


@dataclass(slots=True)
class _AssistantRun:
    reasoning: str | None = None
    texts: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        # Text pieces of one turn are concatenated: a streamed turn may arrive as several of them.
        msg: dict[str, Any] = {"role": "assistant",
                               "content": join_reasoning(self.reasoning, "".join(self.texts)) or None}
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg


@dataclass(slots=True)
class InputItems:
    messages: list[dict[str, Any]]
    item_ids: set[str]
    """Ids the client gave its items (to spot outputs of a previous response sent again)."""


def _str(item: dict, key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}")
    return v


def _parts_text(content: Any, path: str, allowed: tuple[str, ...], sep: str) -> str:
    """The text of ``content`` at ``path``: a string, or a list of parts of the ``allowed`` types."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{path} must be a string or a list of content parts", path)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise bad_request(f"{path}[{j}] has type {kind!r}; this gateway serves text models and takes "
                              f"{', '.join(allowed)} parts here", f"{path}[{j}].type")
        texts.append(_str(part, "refusal" if kind == "refusal" else "text", f"{path}[{j}]"))
    return sep.join(texts)


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its ``reasoning_text`` content, else its summary."""
    if item.get("content"):
        return _parts_text(item["content"], f"{where}.content", ("reasoning_text",), "")
    summary = item.get("summary") or []
    if not isinstance(summary, list) or not all(isinstance(s, dict) for s in summary):
        raise bad_request(f"{where}.summary must be a list of summary_text parts", f"{where}.summary")
    return "\n\n".join(_str(s, "text", f"{where}.summary[{j}]") for j, s in enumerate(summary))


def input_items(value: Any) -> InputItems:
    """The chat messages of ``input`` (400 in OpenAI's shape for what cannot be translated)."""
    if isinstance(value, str):
        return InputItems([{"role": "user", "content": value}], set())
    if not isinstance(value, list):
        raise bad_request("'input' must be a string or a list of items", "input")
    messages: list[dict[str, Any]] = []
    ids: set[str] = set()
    run: _AssistantRun | None = None
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where)
        if isinstance(item.get("id"), str):
            ids.add(item["id"])
        kind = item.get("type") or ("message" if "role" in item else None)
        role = item.get("role")
        if kind == "message" and role == "assistant":
            run = run or _AssistantRun()
            run.texts.append(_parts_text(item.get("content"), f"{where}.content",
                                         ("output_text", "input_text", "refusal"), ""))
            continue
        if kind in _ASSISTANT_ITEMS:
            if kind == "reasoning" and run is not None:  # a reasoning item starts the next turn
                messages.append(run.message())
                run = None
            run = run or _AssistantRun()
            if kind == "reasoning":
                run.reasoning = _reasoning_text(item, where)
            else:
                run.calls.append({"id": _str(item, "call_id", where), "type": "function", "function": {
                    "name": _str(item, "name", where), "arguments": _str(item, "arguments", where)}})
            continue
        if run is not None:
            messages.append(run.message())
            run = None
        if kind == "message":
            if role not in _USER_ROLES:
                raise bad_request(f"{where}.role must be one of user, assistant, system, developer; got {role!r}",
                                  f"{where}.role")
            content = _parts_text(item.get("content"), f"{where}.content", ("input_text",), "\n")
            messages.append({"role": role, "content": content})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _str(item, "call_id", where),
                             "content": _parts_text(item.get("output"), f"{where}.output",
                                                    ("input_text", "output_text"), "\n")})
        elif kind == "item_reference":
            raise bad_request(f"{where}: item_reference is not supported; send the item itself, or chain the "
                              "conversation with previous_response_id", f"{where}.type")
        else:
            raise bad_request(f"{where} has unknown type {kind!r}; this gateway takes message, reasoning, "
                              "function_call and function_call_output items", f"{where}.type")
    if run is not None:
        messages.append(run.message())
    if not messages:
        raise bad_request("'input' must not be empty", "input")
    return InputItems(messages, ids)


def check_tool_outputs(messages: list[dict[str, Any]]) -> None:
    """Every ``function_call_output`` must answer a function call made earlier in the conversation."""
    calls: set[str] = set()
    for m in messages:
        for c in m.get("tool_calls") or ():
            calls.add(c.get("id"))
        if m["role"] == "tool" and m.get("tool_call_id") not in calls:
            raise bad_request(f"No tool call found for function call output with call_id "
                              f"'{m.get('tool_call_id')}': it must follow a function_call with that call_id "
                              "(in input, or in the response named by previous_response_id)", "input")


# ------------------------------------------------------------------------------------------- output items


def item_ids(response_id: str, n_calls: int) -> tuple[str, str, list[str]]:
    """``(reasoning id, message id, function call ids)`` of a response's output items."""
    key = response_id.removeprefix("resp_")
    return f"rs_{key}", f"msg_{key}", [f"fc_{key}_{i}" for i in range(n_calls)]


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [output_text_part(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call: dict[str, Any], status: str, *, arguments: bool = True
                       ) -> dict[str, Any]:
    fn = call.get("function") or {}
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call.get("id"),
            "name": fn.get("name"), "arguments": fn.get("arguments", "") if arguments else ""}


def output_items(response_id: str, turn: Turn, *, incomplete: bool) -> list[dict[str, Any]]:
    """A turn's output items in their canonical order: reasoning, message (when there is text or no call),
    function calls. A response cut short marks its last item incomplete (unless that is a call, which was
    whole when it was parsed)."""
    rs, msg, fcs = item_ids(response_id, len(turn.tool_calls))
    items = []
    if turn.reasoning is not None:
        items.append(reasoning_item(rs, turn.reasoning, "completed"))
    if turn.text or not turn.tool_calls:
        items.append(message_item(msg, turn.text, "completed"))
    items += [function_call_item(fc, c, "completed") for fc, c in zip(fcs, turn.tool_calls, strict=True)]
    if incomplete and items[-1]["type"] != "function_call":
        items[-1]["status"] = "incomplete"
    return items
