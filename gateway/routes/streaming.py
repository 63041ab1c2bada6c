"""SSE streaming in OpenAI's chunk format: upstream deltas → incremental detokenization → stop-string
hold-back → streaming tool-call parsing → ``chat.completion.chunk`` / ``text_completion`` chunks, a
final chunk per choice with its finish_reason, the usage chunk when asked, then ``data: [DONE]``.

The call is recorded once the stream ends, including when the client disconnects (status error, the
tokens produced so far) — the upstream iterator is closed, which aborts the generation upstream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from tracegym.gateway.calls import (
    CallContext,
    Prompt,
    assistant_message,
    build_record,
    choice_record,
    completion_logprobs_of,
    finish_call,
    logprob_entries,
    openai_finish_reason,
    prompt_token_count,
    tracegym_field,
    trim_stop,
    usage,
)
from tracegym.gateway.deps import Services
from tracegym.gateway.errors import OpenAIError
from tracegym.gateway.upstream.base import GenChoice, StreamEvent
from tracegym.gateway.validation import ParsedRequest

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


class ChoiceStream:
    """One choice's stream state: accumulated ids/logprobs/text and the text still held back."""

    def __init__(self, svc: Services, parsed: ParsedRequest, index: int) -> None:
        self.svc, self.parsed, self.index = svc, parsed, index
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""  # everything decoded so far (before stop trimming)
        self.sent = 0  # chars of self.text already released
        self.hold = max((len(s) for s in parsed.sampling.stop), default=1) - 1
        native = svc.upstream.token_native and svc.tokenizer is not None
        self.decoder = IncrementalDecoder(svc.tokenizer) if native else None
        self.tool_parser = _tool_parser() if parsed.parse_tools and native else None
        self.upstream_tool_calls: dict[int, dict[str, Any]] = {}
        self.finish: str | None = None
        self.stop_matched: str | None = None
        self.saw_tool_call = False
        self.parsed_content = ""
        self.parsed_calls: list[dict[str, Any]] = []
        self.weight_versions: list | None = None  # set when the choice was continued across a swap

    def push(self, ch: GenChoice) -> tuple[list[dict[str, Any]], list[dict] | None]:
        """(delta objects to send, logprob entries of the new tokens or None)."""
        if ch.output_ids:
            self.ids.extend(ch.output_ids)
        if ch.logprobs:
            self.logprobs.extend(ch.logprobs)
        new_text = self.decoder.push(ch.output_ids or []) if self.decoder else (ch.text or "")
        self.text += new_text
        lps = logprob_entries(self.svc, ch) if self.parsed.logprobs else None
        deltas = [{"tool_calls": ch.tool_call_deltas}] if ch.tool_call_deltas else []
        if ch.tool_call_deltas:
            self.saw_tool_call = True
            _merge_tool_deltas(self.upstream_tool_calls, ch.tool_call_deltas)
        if ch.finish_reason is not None:
            self.finish, self.stop_matched = ch.finish_reason, ch.stop_matched
            self.weight_versions = ch.weight_versions
            if self.decoder:
                self.text += self.decoder.flush()
            release = trim_stop(self.text, self.stop_matched)[self.sent:]
            self.sent = len(self.text)
            return deltas + self._text_deltas(release, final=True), lps
        end = max(self.sent, len(self.text) - self.hold) if self.parsed.sampling.stop else len(self.text)
        release, self.sent = self.text[self.sent:end], end
        return deltas + self._text_deltas(release, final=False), lps

    def _text_deltas(self, text: str, *, final: bool) -> list[dict[str, Any]]:
        if self.tool_parser is None:
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
                self.parsed_content += ev.text
            out.append(delta)
        return out

    def streamed_message(self) -> dict[str, Any] | None:
        """With the tool parser: exactly the content and calls the client was sent (same call ids)."""
        if self.tool_parser is None:
            return None
        msg: dict[str, Any] = {"role": "assistant", "content": self.parsed_content or None}
        if self.parsed_calls:
            msg["tool_calls"] = self.parsed_calls
        return msg

    def final_choice(self) -> GenChoice:
        message = None
        if self.decoder is None and self.parsed.operation == "chat":
            calls = [self.upstream_tool_calls[k] for k in sorted(self.upstream_tool_calls)]
            message = {"content": trim_stop(self.text, self.stop_matched) or None, "tool_calls": calls or None}
        return GenChoice(index=self.index, output_ids=self.ids if self.decoder else (self.ids or None),
                         logprobs=self.logprobs if self.logprobs else None, text=self.text,
                         message=message, finish_reason=self.finish, stop_matched=self.stop_matched,
                         weight_versions=self.weight_versions)


def _tool_parser() -> Any:
    from tracegym.gateway.tools import StreamingToolParser

    return StreamingToolParser()


def _merge_tool_deltas(acc: dict[int, dict[str, Any]], deltas: list[dict[str, Any]]) -> None:
    for d in deltas:
        i = int(d.get("index", 0))
        cur = acc.setdefault(i, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        if d.get("id"):
            cur["id"] = d["id"]
        fn = d.get("function") or {}
        cur["function"]["name"] += fn.get("name") or ""
        cur["function"]["arguments"] += fn.get("arguments") or ""


class StreamWriter:
    """Builds the chunks of one streamed call and records it when the stream ends."""

    def __init__(self, svc: Services, parsed: ParsedRequest, ctx: CallContext, prompt: Prompt) -> None:
        self.svc, self.parsed, self.ctx, self.prompt = svc, parsed, ctx, prompt
        self.chat = parsed.operation == "chat"
        self.choices = {i: ChoiceStream(svc, parsed, i) for i in range(parsed.sampling.n)}
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
        self.weight_version = ev.weight_version or self.weight_version
        self.prompt_tokens = ev.prompt_tokens or self.prompt_tokens
        self.prompt_ids = ev.prompt_ids or self.prompt_ids
        if ev.choice is None:  # token counts only
            self.completion_tokens = ev.completion_tokens or self.completion_tokens
            return []
        if self.first_token_ns is None and (ev.choice.output_ids or ev.choice.text):
            self.first_token_ns = time.time_ns()
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

    def _prompt_tokens(self) -> int:
        return self.prompt_tokens or (len(self.prompt_ids) if self.prompt_ids else
                                      prompt_token_count(0, self.prompt))

    def _output_tokens(self) -> int:
        return sum(len(s.ids) for s in self.choices.values()) or self.completion_tokens

    def record(self, error: str | None) -> None:
        records = []
        for st in self.choices.values():
            ch = st.final_choice()
            if self.chat:
                msg = st.streamed_message() or assistant_message(
                    self.svc, self.parsed, ch, trim_stop(st.text, st.stop_matched))
                finish = openai_finish_reason(ch, msg) if st.finish else None
            else:
                msg, finish = {"text": trim_stop(st.text, st.stop_matched)}, st.finish
            records.append(choice_record(ch, finish, msg, self.weight_version))
        exact = self.prompt_ids is not None and all(st.ids for st in self.choices.values())
        retok = not self.svc.upstream.token_native and not exact
        rec = build_record(self.svc, self.parsed, self.ctx, self.prompt, records,
                           weight_version=self.weight_version, prompt_tokens=self._prompt_tokens(),
                           retokenized=retok, first_token_ns=self.first_token_ns, error=error,
                           upstream_prompt_ids=self.prompt_ids, reported_output_tokens=self.completion_tokens)
        finish_call(self.svc, self.ctx, rec)
        if self.on_done is not None:
            self.on_done()


async def sse_stream(
    writer: StreamWriter, first: StreamEvent | None, events: AsyncIterator[StreamEvent]
) -> AsyncIterator[bytes]:
    """The response body. ``first`` was pulled before the response started (so connection errors
    became proper 502/504 statuses); errors after that arrive as an SSE error event."""
    error: str | None = "client disconnected"
    try:
        for b in writer.opening():
            yield b
        if first is not None:
            for b in writer.on_event(first):
                yield b
        async for ev in events:
            for b in writer.on_event(ev):
                yield b
        error = None
        for b in writer.closing():
            yield b
    except OpenAIError as e:
        error = e.message
        yield sse(e.body())
        yield DONE
    except asyncio.CancelledError:
        error = "client disconnected"
        raise
    except Exception as e:  # a bug or a malformed upstream stream: recorded, then re-raised
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        aclose = getattr(events, "aclose", None)
        if error is not None and aclose is not None:
            await _close_quietly(aclose)
        writer.record(error)


async def _close_quietly(aclose: Any) -> None:
    try:
        await aclose()
    except (asyncio.CancelledError, Exception):  # closing an already broken upstream stream
        return
