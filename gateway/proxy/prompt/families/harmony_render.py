"""gpt-oss's chat template with its message loop written in Python: for the official template only
(``modelfiles/templates/gpt_oss.jinja``, recognised by its SHA-256), it renders the text the template renders
(``tests/gateway/proxy/prompt/test_harmony_render.py`` compares the two on the family corpus and on the inputs
the loop leaves to the template).

The template is two parts. Its head, up to ``{#- Render messages #}``, writes the system message (model
identity, knowledge cutoff, today's date, reasoning effort, builtin tools) and the developer message (the first
message when it is a system message, and the tool namespace): it is rendered by the template's own source up
to there, and kept per what it reads (whether the first message is a system message and its content, the
tools, the template variables, the date). The rest, one harmony message per message and the generation prompt,
is ``_loop``. Where the template would raise, or an input has a shape the loop does not take (a value that
is not a string where the template writes or searches one, a call without a named ``function``, a
``content_type``, a template variable shadowing a global the template calls), the renderer answers None and
the whole template renders it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from tracegym.gateway.proxy.prompt.caches import BoundedLRU
from tracegym.gateway.proxy.prompt.jinja_env import _strftime_now, _Unkeyable, compile_template, memo_key

TEMPLATE_SHA256 = "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146"
"""The official template (openai/gpt-oss-120b's ``chat_template.jinja``) this renderer is proven against."""
LOOP_MARK = "{#- Render messages #}"
"""Where the template's head ends (the comment strips the whitespace before it, so the head ends with it)."""
DATE_FORMAT = "%Y-%m-%d"
"""The head's only ``strftime_now`` format."""
_SHADOWING = frozenset({"namespace", "raise_exception", "strftime_now"})
"""Globals the template calls: a template variable of that name replaces them in the template's render."""
_TAGS = ("<|channel|>analysis<|message|>", "<|channel|>final<|message|>")
"""Text the template refuses in an assistant message's content and thinking."""
_ANALYSIS = "<|start|>assistant<|channel|>analysis<|message|>"
_FINAL = "<|start|>assistant<|channel|>final<|message|>"
_CALL = "<|start|>assistant to=functions."
_RESULT = "<|start|>functions."
_END = "<|end|>"
_MISSING = object()


class HarmonyRenderer:
    """``render(messages, tools, add_generation_prompt, context)``: the official template's text for the
    prepared messages (``gpt_oss.prepare``) and the template variables ``context``, or None where the template
    renders it. Its heads are kept in a bounded memo; one renderer per tokenizer."""

    def __init__(self, source: str) -> None:
        self._head = compile_template(source[: source.index(LOOP_MARK) + len(LOOP_MARK)])
        self.heads = BoundedLRU(max_entries=256, max_chars=4 * 1024 * 1024)
        self._encode = json.JSONEncoder(ensure_ascii=False).encode  # the template's ``tojson`` (json.dumps)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool, context: dict[str, Any]) -> str | None:
        if not messages or not _SHADOWING.isdisjoint(context):
            return None
        first = messages[0]
        system = first.get("role") in ("developer", "system")
        head = self._head_text(messages, system, tools, context)
        if head is None:
            return None
        loop = self._loop(messages, 1 if system else 0, bool(add_generation_prompt))
        if loop is None:
            return None
        return head + loop + ("<|start|>assistant" if add_generation_prompt else "")

    def _head_text(self, messages: list[dict[str, Any]], system: bool, tools: list[dict[str, Any]] | None,
                   context: dict[str, Any]) -> str | None:
        """The head as the template renders it for these inputs, through the memo. The head reads the first
        message (its role; its content when it is a system message), ``tools``, the template variables
        and the date, so that is its key."""
        today = _strftime_now(DATE_FORMAT)  # the template's own clock
        try:
            key = (messages[0].get("content") if system else None, memo_key(tools), memo_key(context), today)
            hash(key)
        except (_Unkeyable, TypeError):
            return None
        text = self.heads.get(key)
        if text is None:
            text = self._head.render(messages=messages, tools=tools, documents=None, add_generation_prompt=False,
                                     **context)
            if _strftime_now(DATE_FORMAT) == today:  # (a head rendered across midnight is not kept)
                self.heads.put(key, text, len(text))
        return text

    def _loop(self, messages: list[dict[str, Any]], start: int, gen: bool) -> str | None:
        """The messages after the head as the template's loop writes them; None where the template raises or
        an input is outside what this writes."""
        out: list[str] = []
        last_call: str | None = None  # the template's ``last_tool_call.name``
        final_after = _final_after(messages, start)
        last = len(messages) - 1
        for i in range(start, len(messages)):
            m = messages[i]
            role = m.get("role")
            content = m.get("content", _MISSING)
            if type(content) is not str:
                return None
            if role == "assistant":
                if _TAGS[0] in content or _TAGS[1] in content:
                    return None
                thinking = m.get("thinking", _MISSING)
                if thinking is not _MISSING and (type(thinking) is not str or _TAGS[0] in thinking
                                                 or _TAGS[1] in thinking):
                    return None
                has_thinking = thinking is not _MISSING
                if "tool_calls" in m:
                    call = _call(m["tool_calls"])
                    if call is None or (content and has_thinking and thinking):
                        return None
                    name, arguments = call
                    if not final_after[i - start]:
                        if content:
                            out += (_ANALYSIS, content, _END)
                        elif has_thinking and thinking:
                            out += (_ANALYSIS, thinking, _END)
                    try:
                        args = self._encode(arguments)
                    except (TypeError, ValueError, RecursionError):
                        return None
                    out += (_CALL, name, "<|channel|>commentary json<|message|>", args, "<|call|>")
                    last_call = name
                elif i == last and not gen:
                    if has_thinking:
                        out += (_ANALYSIS, thinking, _END)
                    out += (_FINAL, content, "<|return|>")
                else:
                    out += (_FINAL, content, _END)
                    last_call = None
            elif role == "tool":
                if last_call is None:
                    return None
                out += (_RESULT, last_call, " to=assistant<|channel|>commentary<|message|>", self._encode(content),
                        _END)
            elif role == "user":
                out += ("<|start|>user<|message|>", content, _END)
        return "".join(out)


def _final_after(messages: list[dict[str, Any]], start: int) -> list[bool]:
    """For each message from ``start``: whether an assistant message without ``tool_calls`` follows it (the
    template then drops a call's analysis)."""
    out = [False] * (len(messages) - start)
    seen = False
    for i in range(len(messages) - 1, start - 1, -1):
        out[i - start] = seen
        m = messages[i]
        if m.get("role") == "assistant" and "tool_calls" not in m:
            seen = True
    return out


def _call(calls: Any) -> tuple[str, Any] | None:
    """``(name, arguments)`` of a message's first call as the template reads it, when it is a ``function``
    object with a string name and no ``content_type``; else None."""
    if type(calls) is not list or not calls or type(calls[0]) is not dict:
        return None
    fn = calls[0].get("function")
    if type(fn) is not dict or not fn or "content_type" in fn or "arguments" not in fn:
        return None
    name = fn.get("name")
    return (name, fn["arguments"]) if type(name) is str else None


def harmony_renderer(source: str) -> HarmonyRenderer | None:
    """A renderer for ``source`` when it is the official template (None: the template renders itself)."""
    if hashlib.sha256(source.encode()).hexdigest() != TEMPLATE_SHA256:
        return None
    return HarmonyRenderer(source)

