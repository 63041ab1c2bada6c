"""Reasoning parsing: ``<think>`` blocks split off a reply, whole and streamed, and the canonical join."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracegym.gateway.proxy.prompt.reasoning import (
    StreamingReasoningParser,
    join_reasoning,
    split_reasoning,
)


@pytest.mark.parametrize(("text", "opens", "want"), [
    ("Hello", False, (None, "Hello")),
    ("  Hello <think>x</think>", False, (None, "  Hello <think>x</think>")),
    ("<think>\nplan\n</think>\n\nAnswer", False, ("plan", "Answer")),
    ("\n <think>a b</think>c", False, ("a b", "c")),
    ("<think>cut off mid-thought ", False, ("cut off mid-thought", "")),
    ("<think>\n\n</think>\n\nA", False, ("", "A")),
    ("plan\n</think>\n\nA", True, ("plan", "A")),
    ("no end", True, ("no end", "")),
    ("", False, (None, "")),
])
def test_split(text: str, opens: bool, want: tuple) -> None:
    assert split_reasoning(text, opens_in_reasoning=opens) == want


def test_join_inverts_split_on_the_canonical_form() -> None:
    text = "<think>\nI add 2 and 3.\n</think>\n\nIt is 5."
    assert join_reasoning(*split_reasoning(text)) == text
    assert split_reasoning(join_reasoning("r", "t")) == ("r", "t")
    assert split_reasoning(join_reasoning("", None)) == ("", "")
    assert join_reasoning(None, "plain") == "plain" and join_reasoning(None, None) == ""


def _stream(text: str, cuts: list[int], opens: bool) -> tuple[str | None, str, list[str]]:
    p = StreamingReasoningParser(opens_in_reasoning=opens)
    events = []
    last = 0
    for c in [*sorted(cuts), len(text)]:
        events += p.feed(text[last:c])
        last = c
    events += p.finish()
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    kinds = [e.kind for e in events]
    # reasoning deltas always come before text deltas
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning")
    return (reasoning if p.started else None), "".join(e.text for e in events if e.kind == "text"), kinds


PIECES = st.sampled_from(["<think>", "</think>", "<thi", "nk>", "</th", "\n", " ", "a", "bc", "\n\n", "é"])


@settings(max_examples=400, deadline=None)
@given(st.lists(PIECES, max_size=12).map("".join), st.lists(st.integers(0, 60), max_size=6), st.booleans())
def test_streaming_equals_whole(text: str, cuts: list[int], opens: bool) -> None:
    cuts = [c for c in cuts if c <= len(text)]
    reasoning, rest, _ = _stream(text, cuts, opens)
    assert (reasoning, rest) == split_reasoning(text, opens_in_reasoning=opens)


def test_streaming_releases_reasoning_before_it_ends() -> None:
    p = StreamingReasoningParser()
    assert [(e.kind, e.text) for e in p.feed("<think>\nstep one")] == [("reasoning", "step one")]
    assert [(e.kind, e.text) for e in p.feed(" and two  ")] == [("reasoning", " and two")]  # spaces held
    assert [(e.kind, e.text) for e in p.feed("</thi")] == []
    assert [(e.kind, e.text) for e in p.feed("nk>\n\nDone")] == [("text", "Done")]
    assert p.finish() == [] and p.started


def test_plain_text_streams_at_once() -> None:
    p = StreamingReasoningParser()
    assert [(e.kind, e.text) for e in p.feed("Hello")] == [("text", "Hello")]
    assert [(e.kind, e.text) for e in p.feed(" there")] == [("text", " there")]
