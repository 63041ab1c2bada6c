"""SSE streaming in OpenAI's chunk format: upstream deltas → incremental detokenization → stop-string
hold-back → the reasoning split (``delta.reasoning_content``, for reasoning templates: ``openai_replies.
separates_reasoning``) → streaming tool-call parsing → ``chat.completion.chunk`` / ``text_completion`` chunks, a
final chunk per choice with its finish_reason, the usage chunk when asked, then ``data: [DONE]``.

The call is recorded once the stream ends, including when the client disconnects (status error, the
tokens produced so far) — the upstream iterator is closed, which aborts the generation upstream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import orjson

from tracegym.gateway.deps import Services
from tracegym.gateway.openai_errors import OpenAIError
from tracegym.gateway.proxy.call_context import (
    CallContext,
    Prompt,
    acknowledge,
    build_record,
    choice_record,
    finish_call,
    prompt_token_count,
    settled,
)
from tracegym.gateway.proxy.openai_replies import (
    assistant_message,
    completion_logprobs_of,
    family_of,
    logprob_entries,
    openai_finish_reason,
    opens_in_reasoning,
    separates_reasoning,
    tracegym_field,
    trim_stop,
    usage,
)
from tracegym.gateway.proxy.prompt.reasoning import StreamingReasoningParser
from tracegym.gateway.proxy.prompt.tools import combine_status
from tracegym.gateway.proxy.sse_response import LastChunk
from tracegym.gateway.proxy.upstream.base import GenChoice, StreamEvent
from tracegym.gateway.proxy.validation import ParsedRequest

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class IncrementalDecoder:
    """Detokenizes a growing id list in O(window) per step (vLLM's prefix/read offsets), holding back
    text that ends in an incomplete UTF-8 sequence."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = self.tok.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = self.tok.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]


class TextBuilder:
    """Text built from many small pieces, joined when read: a stream appends a piece per token, and
    ``str +=`` on an attribute copies the whole text each time (quadratic in the reply's length)."""

    __slots__ = ("_len", "_parts")

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._len = 0

    def add(self, piece: str) -> None:
        if piece:
            self._parts.append(piece)
            self._len += len(piece)

    def __len__(self) -> int:
        return self._len

    def value(self) -> str:
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""


class ChoiceStream:
    """One choice's stream state: accumulated ids/logprobs/text and the text still held back."""

    def __init__(self, svc: Services, parsed: ParsedRequest, index: int, *, parse_tools: bool = True,
                 reasoning: StreamingReasoningParser | None = None) -> None:
        """``parse_tools=False``: content deltas stay raw text (the Responses and Messages streams split
        reasoning off first and parse tool calls in what follows, ``proxy/reply_parts.py``). ``reasoning``: split
        the text into ``reasoning_content`` and content deltas first (chat)."""
        self.svc, self.parsed, self.index = svc, parsed, index
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self._text = TextBuilder()  # everything decoded so far (before stop trimming)
        self._unsent = ""  # its tail not yet released: at most the stop hold-back and the newest piece
        self.sent = 0  # chars of the text already released
        self.hold = max((len(s) for s in parsed.sampling.stop), default=1) - 1
        native = svc.upstream.token_native and svc.tokenizer is not None
        self.decoder = IncrementalDecoder(svc.tokenizer) if native else None
        family = family_of(svc)
        reads = parsed.parse_tools or family.framed_replies  # harmony's content is read out of its frames
        self.tool_parser = (family.stream_tools(parsed.tool_names if parsed.parse_tools else ())
                            if parse_tools and reads and native else None)
        self._records_parse = parsed.parse_tools
        self.reasoning = reasoning
        self._parsed_reasoning = TextBuilder()
        self.upstream_tool_calls: dict[int, dict[str, Any]] = {}
        self.finish: str | None = None
        self.stop_matched: str | None = None
        self.saw_tool_call = False
        self._parsed_content = TextBuilder()
        self.parsed_calls: list[dict[str, Any]] = []
        self.weight_versions: list | None = None  # set when the choice was continued across a swap

    def push(self, ch: GenChoice) -> tuple[list[dict[str, Any]], list[dict] | None]:
        """(delta objects to send, logprob entries of the new tokens or None)."""
        if ch.output_ids:
            self.ids.extend(ch.output_ids)
        if ch.logprobs:
            self.logprobs.extend(ch.logprobs)
        new_text = self.decoder.push(ch.output_ids or []) if self.decoder else (ch.text or "")
        self._text.add(new_text)
        self._unsent += new_text
        lps = logprob_entries(self.svc, ch, self.parsed.tokens_as_ids) if self.parsed.logprobs else None
        deltas = [{"tool_calls": ch.tool_call_deltas}] if ch.tool_call_deltas else []
        if ch.tool_call_deltas:
            self.saw_tool_call = True
            _merge_tool_deltas(self.upstream_tool_calls, ch.tool_call_deltas)
        if ch.finish_reason is not None:
            self.finish, self.stop_matched = ch.finish_reason, ch.stop_matched
            self.weight_versions = ch.weight_versions
            if self.decoder:
                self._text.add(self.decoder.flush())
            release = trim_stop(self.text, self.stop_matched)[self.sent:]
            self.sent, self._unsent = len(self._text), ""
            return deltas + self._text_deltas(release, final=True), lps
        n = len(self._text)
        end = max(self.sent, n - self.hold) if self.parsed.sampling.stop else n
        k = end - self.sent
        release, self._unsent, self.sent = self._unsent[:k], self._unsent[k:], end
        return deltas + self._text_deltas(release, final=False), lps

    @property
    def text(self) -> str:
        """Everything decoded so far (before stop trimming)."""
        return self._text.value()

    @property
    def parsed_content(self) -> str:
        return self._parsed_content.value()

    @property
    def parsed_reasoning(self) -> str:
        return self._parsed_reasoning.value()

    def _text_deltas(self, text: str, *, final: bool) -> list[dict[str, Any]]:
        if self.reasoning is None:
            return self._content_deltas(text, final=final)
        pieces = self.reasoning.feed(text) if text else []
        if final:
            pieces += self.reasoning.finish()
        out: list[dict[str, Any]] = []
        for piece in pieces:
            if piece.kind == "reasoning":
                self._parsed_reasoning.add(piece.text)
                out.append({"reasoning_content": piece.text})
            else:
                out += self._content_deltas(piece.text, final=False)
        return out + (self._content_deltas("", final=True) if final else [])

    def _content_deltas(self, text: str, *, final: bool) -> list[dict[str, Any]]:
        if self.tool_parser is None:
            self._parsed_content.add(text)
            return [{"content": text}] if text else []
        events = self.tool_parser.feed(text) if text else []
        if final:
            events += self.tool_parser.finish()
        out = []
        for ev in events:
            delta = ev.to_delta()
            if ev.kind == "tool_call":
                self.saw_tool_call = True
                self.parsed_calls.append({k: v for k, v in delta["tool_calls"][0].items() if k != "index"})
            else:
                self._parsed_content.add(ev.text)
            out.append(delta)
        return out

    def streamed_message(self) -> dict[str, Any] | None:
        """With the tool parser or the reasoning split: exactly the reasoning, content and calls the client
        was sent (same call ids)."""
        if self.tool_parser is None and self.reasoning is None:
            return None
        content = self.parsed_content or (None if self.tool_parser is not None else "")
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None and self.reasoning.started:
            msg["reasoning_content"] = self.parsed_reasoning
        if self.parsed_calls:
            msg["tool_calls"] = self.parsed_calls
        return msg

    @property
    def tool_parse(self) -> str | None:
        return self.tool_parser.status if self.tool_parser is not None and self._records_parse else None

    def final_choice(self) -> GenChoice:
        message = None
        if self.decoder is None and self.parsed.operation == "chat":
            calls = [self.upstream_tool_calls[k] for k in sorted(self.upstream_tool_calls)]
            message = {"content": trim_stop(self.text, self.stop_matched) or None, "tool_calls": calls or None}
        return GenChoice(index=self.index, output_ids=self.ids if self.decoder else (self.ids or None),
                         logprobs=self.logprobs if self.logprobs else None, text=self.text,
                         message=message, finish_reason=self.finish, stop_matched=self.stop_matched,
                         weight_versions=self.weight_versions)


def _merge_tool_deltas(acc: dict[int, dict[str, Any]], deltas: list[dict[str, Any]]) -> None:
    for d in deltas:
        i = int(d.get("index", 0))
        cur = acc.setdefault(i, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        if d.get("id"):
            cur["id"] = d["id"]
        fn = d.get("function") or {}
        cur["function"]["name"] += fn.get("name") or ""
        cur["function"]["arguments"] += fn.get("arguments") or ""


def absorb(writer: Any, ev: StreamEvent) -> bool:
    """Take an upstream event's call-wide facts into ``writer`` (weight version, prompt, token counts, the
    first token's time), for every API's stream writer; True when the event carries a choice's delta."""
    writer.weight_version = ev.weight_version or writer.weight_version
    writer.prompt_tokens = ev.prompt_tokens or writer.prompt_tokens
    writer.prompt_ids = ev.prompt_ids or writer.prompt_ids
    if ev.choice is None:  # token counts only
        writer.completion_tokens = ev.completion_tokens or writer.completion_tokens
        return False
    if writer.first_token_ns is None and (ev.choice.output_ids or ev.choice.text):
        writer.first_token_ns = time.time_ns()
    return True


class StreamWriter:
    """Builds the chunks of one streamed call and records it when the stream ends."""

    def __init__(self, svc: Services, parsed: ParsedRequest, ctx: CallContext, prompt: Prompt) -> None:
        self.svc, self.parsed, self.ctx, self.prompt = svc, parsed, ctx, prompt
        self.chat = parsed.operation == "chat"
        split = self.chat and separates_reasoning(svc, parsed)
        opens = split and opens_in_reasoning(svc, prompt)
        self.choices = {i: ChoiceStream(svc, parsed, i, reasoning=family_of(svc).stream_reasoning(opens) if split else None)
                        for i in range(parsed.sampling.n)}
        self.weight_version: str | None = None
        self.prompt_tokens = 0
        self.prompt_ids: list[int] | None = None
        self.completion_tokens = 0  # as the upstream reported it (OpenAI-compatible usage chunk)
        self.first_token_ns: int | None = None
        self.on_done: Callable[[], None] | None = None

    def chunk(self, index: int, delta: dict[str, Any], *, logprobs: list | None = None,
              finish: str | None = None, token_ids: list[int] | None = None) -> bytes:
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": {"content": logprobs} if logprobs else None,
                      "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": delta.get("content", ""), "finish_reason": finish,
                      "logprobs": completion_logprobs_of(logprobs, offsets=False) if logprobs else None}
            obj = "text_completion"
        out: dict[str, Any] = {"id": self.ctx.call_id, "object": obj, "created": self.ctx.created,
                               "model": self.svc.served_model, "choices": [choice]}
        if self.parsed.include_usage:
            out["usage"] = None
        if finish is not None:
            out["tracegym"] = tracegym_field(self.ctx, self.weight_version, self.prompt)
        if self.parsed.return_token_ids:
            choice["token_ids"] = token_ids or []
        return sse(out)

    def on_event(self, ev: StreamEvent) -> list[bytes]:
        if not absorb(self, ev):
            return []
        assert ev.choice is not None
        st = self.choices.get(ev.choice.index)
        if st is None:
            raise OpenAIError(502, f"upstream streamed an unknown choice index {ev.choice.index}")
        deltas, lps = st.push(ev.choice)
        ids = ev.choice.output_ids if self.parsed.return_token_ids else None
        out = [self.chunk(st.index, d, logprobs=lps if k == 0 else None, token_ids=ids if k == 0 else None)
               for k, d in enumerate(deltas)]
        if (lps or ids) and not deltas:
            out.append(self.chunk(st.index, {"content": ""} if self.chat else {}, logprobs=lps, token_ids=ids))
        if st.finish is not None:
            finish = "tool_calls" if (st.saw_tool_call and self.chat) else st.finish
            out.append(self.chunk(st.index, {}, finish=finish))
        return out

    def opening(self) -> list[bytes]:
        if not self.chat:
            return []
        out = [self.chunk(i, {"role": "assistant", "content": ""}) for i in self.choices]
        if self.parsed.return_token_ids and self.prompt.ids is not None:  # vLLM: prompt ids in chunk one
            first = orjson.loads(out[0][6:])
            first["prompt_token_ids"] = self.prompt.ids
            out[0] = sse(first)
        return out

    def closing(self) -> list[bytes]:
        out = []
        if self.parsed.include_usage:
            out.append(sse({"id": self.ctx.call_id, "object": "chat.completion.chunk" if self.chat else
                            "text_completion", "created": self.ctx.created, "model": self.svc.served_model,
                            "choices": [], "usage": usage(self._prompt_tokens(), self._output_tokens()),
                            "tracegym": tracegym_field(self.ctx, self.weight_version, self.prompt)}))
        return [*out, DONE]

    def error_events(self, e: OpenAIError) -> list[bytes]:
        """What ends the stream after an error that came once the response had started."""
        return [sse(e.body()), DONE]

    def _prompt_tokens(self) -> int:
        return self.prompt_tokens or (len(self.prompt_ids) if self.prompt_ids else
                                      prompt_token_count(0, self.prompt))

    def _output_tokens(self) -> int:
        return sum(len(s.ids) for s in self.choices.values()) or self.completion_tokens

    def record(self, error: str | None) -> Awaitable[bool] | None:
        records, statuses = [], []
        for st in self.choices.values():
            ch = st.final_choice()
            if self.chat:
                msg, status = st.streamed_message(), st.tool_parse
                if msg is None:
                    msg, status = assistant_message(self.svc, self.parsed, ch, trim_stop(st.text, st.stop_matched))
                statuses.append(status)
                finish = openai_finish_reason(ch, msg) if st.finish else None
            else:
                msg, finish = {"text": trim_stop(st.text, st.stop_matched)}, st.finish
            records.append(choice_record(ch, finish, msg, self.weight_version))
        exact = self.prompt_ids is not None and all(st.ids for st in self.choices.values())
        retok = not self.svc.upstream.token_native and not exact
        rec = build_record(self.svc, self.parsed, self.ctx, self.prompt, records,
                           weight_version=self.weight_version, prompt_tokens=self._prompt_tokens(),
                           retokenized=retok, first_token_ns=self.first_token_ns, error=error,
                           upstream_prompt_ids=self.prompt_ids, reported_output_tokens=self.completion_tokens,
                           tool_parse=combine_status(statuses))
        ack = finish_call(self.svc, self.ctx, rec)
        if self.on_done is not None:
            self.on_done()
        return ack


class EventWriter(Protocol):
    """What ``sse_stream`` drives: one API's stream format (``StreamWriter`` for OpenAI's chunks; the
    Responses and Messages writers) over the same upstream events, recording the call at the end."""

    on_done: Callable[[], None] | None

    def opening(self) -> list[bytes]: ...

    def on_event(self, ev: StreamEvent) -> list[bytes]: ...

    def closing(self) -> list[bytes]: ...

    def error_events(self, e: OpenAIError) -> list[bytes]: ...

    def record(self, error: str | None) -> Awaitable[bool] | None:
        """Record the call (once); returns ``call_context.finish_call``'s ack."""


async def sse_stream(
    writer: EventWriter, first: StreamEvent | None, events: AsyncIterator[StreamEvent], commit_timeout_s: float
) -> AsyncIterator[bytes]:
    """The response body. ``first`` was pulled before the response started (so connection errors
    became proper 502/504 statuses); errors after that arrive as the API's SSE error event.

    The events made at one moment (the opening and the first upstream event; those of the upstream events
    received in one read, ``StreamEvent.more``; the closing) go out as one body chunk, one socket write: the
    Responses and Messages grammars send several events where chat sends one chunk, and a write per event
    would cost each call a syscall (and a wake-up of its client) per event. Events received with the
    upstream stream's end go out with the closing: a reply that reaches the gateway in one read (an engine
    it reads behind, a short reply) is one write after its span is committed, as a call that is not streamed.

    The last chunk (the closing events, or the error events) waits until the call's span is committed
    (``call_context.acknowledge``, at most ``commit_timeout_s``); a span the store did not take (in time) ends
    the stream with the API's error event instead of its normal end."""
    error: str | None = "client disconnected"
    recorded = False
    held: list[bytes] = []
    try:
        held = writer.opening()
        if first is not None:
            held += writer.on_event(first)
        if held and (first is None or not first.more):
            yield b"".join(held)
            held = []
        async for ev in events:
            held += writer.on_event(ev)
            if held and not ev.more:  # nothing else received with it: out now
                yield b"".join(held)
                held = []
        error = None
        last = writer.closing()
        recorded = True
        try:
            await acknowledge(writer.record(None), commit_timeout_s)
        except OpenAIError as e:
            last = writer.error_events(e)
        yield LastChunk(b"".join(held + last))
    except OpenAIError as e:
        error = e.message
        await _close_events(events)
        recorded = True
        await settled(writer.record(error), commit_timeout_s)
        yield LastChunk(b"".join(held + writer.error_events(e)))  # what was received before the error, then the error
    except asyncio.CancelledError:
        error = "client disconnected"
        raise
    except Exception as e:  # a bug or a malformed upstream stream: recorded, then re-raised
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        if not recorded:
            if error is not None:
                await _close_events(events)
            writer.record(error)


async def _close_events(events: AsyncIterator[StreamEvent]) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await _close_quietly(aclose)


async def _close_quietly(aclose: Any) -> None:
    try:
        await aclose()
    except (asyncio.CancelledError, Exception):  # closing an already broken upstream stream
        return
