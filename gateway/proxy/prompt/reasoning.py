"""Reasoning text, both ways: a model's ``<think>…</think>`` block ⇄ the Responses API's reasoning item and
the Messages API's thinking block.

One canonical form, which ``join_reasoning`` writes and ``split_reasoning`` inverts::

    <think>\\n{reasoning}\\n</think>\\n\\n{text}

(the form DeepSeek-R1 and Qwen3 write). When a client sends a reasoning item back, the assistant message it
stands for is rendered with that form; a reply the model wrote with other whitespace then re-renders
differently and prefix reuse keeps the sampled ids (drift ``realigned``), never the re-render.

Splitting rules (``split_reasoning`` and ``StreamingReasoningParser`` implement the same ones):
- the reply is reasoning first when, after leading whitespace, it starts with ``<think>``; or when the
  prompt itself ended inside an open ``<think>`` (templates that write it into the generation prompt:
  ``opens_in_reasoning``).
- the reasoning runs to the first ``</think>`` (or to the end of a reply cut off inside it) and is
  stripped of surrounding whitespace; the text after it loses its leading whitespace.
- anything else is text, unchanged (a ``<think>`` later in a reply is text).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

OPEN = "<think>"
CLOSE = "</think>"


def split_reasoning(text: str, *, opens_in_reasoning: bool = False) -> tuple[str | None, str]:
    """``(reasoning or None, text after it)`` of a whole reply."""
    if not opens_in_reasoning:
        body = text.lstrip()
        if not body.startswith(OPEN):
            return None, text
        text = body[len(OPEN):]
    end = text.find(CLOSE)
    if end < 0:
        return text.strip(), ""
    return text[:end].strip(), text[end + len(CLOSE):].lstrip()


def join_reasoning(reasoning: str | None, text: str | None) -> str:
    """The assistant content a reasoning item (or thinking block) and its text stand for."""
    if reasoning is None:
        return text or ""
    return f"{OPEN}\n{reasoning}\n{CLOSE}\n\n{text or ''}"


def _partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


@dataclass(slots=True)
class ReasoningDelta:
    kind: Literal["reasoning", "text"]
    text: str


@dataclass
class StreamingReasoningParser:
    """Incremental ``split_reasoning``: feed text deltas, get reasoning and text deltas as soon as they are
    certain. Holds back a possible partial tag, and whitespace that the split would strip; the
    concatenated reasoning deltas and text deltas equal ``split_reasoning`` of the whole text, and the
    parser says whether there was a reasoning block at all (``started``)."""

    opens_in_reasoning: bool = False
    state: Literal["start", "reasoning", "after", "text"] = "start"
    started: bool = False
    _buf: str = ""
    _lead: bool = True  # no reasoning character emitted yet (leading whitespace is dropped)
    _out: list[ReasoningDelta] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.opens_in_reasoning:
            self.state, self.started = "reasoning", True

    def feed(self, delta: str) -> list[ReasoningDelta]:
        if self.state == "text":  # decided (the buffer is empty then): the rest is text, as it comes
            return [ReasoningDelta("text", delta)] if delta else []
        self._buf += delta
        self._out = []
        self._step(final=False)
        return self._out

    def finish(self) -> list[ReasoningDelta]:
        self._out = []
        self._step(final=True)
        self._buf = ""
        return self._out

    def _emit(self, kind: Literal["reasoning", "text"], text: str) -> None:
        if text:
            self._out.append(ReasoningDelta(kind, text))

    def _step(self, *, final: bool) -> None:
        while True:
            if self.state == "start":
                body = self._buf.lstrip()
                if body.startswith(OPEN):
                    self.state, self.started, self._buf = "reasoning", True, body[len(OPEN):]
                    continue
                if not final and (not body or OPEN.startswith(body)):
                    return  # still undecided
                self.state = "text"
                continue
            if self.state == "reasoning":
                if not self._reasoning(final):
                    return
                continue
            if self.state == "after":
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return
                self.state = "text"
                continue
            self._emit("text", self._buf)
            self._buf = ""
            return

    def _reasoning(self, final: bool) -> bool:
        """Emit what is certain of the reasoning; True once its end was found (state ``after``)."""
        if self._lead:
            self._buf = self._buf.lstrip()
        end = self._buf.find(CLOSE)
        if end >= 0:
            self._emit("reasoning", self._buf[:end].rstrip())
            self._buf, self.state = self._buf[end + len(CLOSE):], "after"
            return True
        if final:
            self._emit("reasoning", self._buf.rstrip())
            self._buf = ""
            return False
        keep = _partial_suffix(self._buf, CLOSE)
        body = self._buf[: len(self._buf) - keep]
        certain = body.rstrip()  # trailing whitespace is dropped if the block ends right after it
        if certain:
            self._lead = False
        self._emit("reasoning", certain)
        self._buf = self._buf[len(certain):]
        return False
