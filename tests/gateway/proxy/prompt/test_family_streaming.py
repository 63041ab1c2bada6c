"""Tool calls stream as they are sampled in Llama 3.x, DeepSeek V3 and gpt-oss (harmony): a reply is
tokenized with the family's real tokenizer (npm ``@lenml/tokenizer-*``, as the tiny models carry it), decoded
token by token as the chat stream decodes it, and fed through the family's streaming readers. Each call
arrives with the token that ends it, content and reasoning as their tokens come, and what was streamed
equals the whole reply's parse."""

from __future__ import annotations

import json

import pytest

from tests.gateway.proxy.prompt import family_corpus as corpus
from tests.shared_tokenizers import ONE_WORKER, chat_tokenizer
from tracegym.gateway.proxy.prompt.templating import ChatTokenizer
from tracegym.gateway.proxy.streaming import IncrementalDecoder

pytestmark = ONE_WORKER

NAMES = [t["function"]["name"] for t in corpus.TOOLS]
CALLS = [corpus.Call("a", "add", {"a": 1, "b": 2.5}), corpus.Call("b", "search", {"query": "熊猫 \"x\" {y}"})]
ARGS = [json.dumps(c.args, ensure_ascii=False) for c in CALLS]


def _harmony_reply() -> str:
    return ("<|channel|>analysis<|message|>The user wants a sum.<|end|><|start|>assistant<|channel|>commentary"
            "<|message|>Checking with the calculator.<|end|><|start|>assistant to=functions.add<|channel|>"
            f"commentary <|constrain|>json<|message|>{ARGS[0]}")


REPLIES = {  # model: (the reply as its model writes it, its stop token)
    "llama3-tiny": ("<|python_tag|>" + corpus.sampled("llama3", "", CALLS), "<|eom_id|>"),
    "deepseek3-tiny": (corpus.sampled("deepseek_v3", "Let me look that up.", CALLS), "<｜end▁of▁sentence｜>"),
    "gptoss-tiny": (_harmony_reply(), "<|call|>"),
}


@pytest.fixture(scope="module", params=list(REPLIES))
def streamed(request: pytest.FixtureRequest) -> tuple[ChatTokenizer, list[int], list[tuple[int, str, object]]]:
    """The family's tokenizer, the reply's ids and what the stream sent: ``(token index, kind, payload)``
    with kind ``reasoning`` / ``content`` (text) or ``call`` ((name, arguments)); index ``len(ids)`` is the
    end of the stream."""
    tok = chat_tokenizer(request.param)
    text, stop = REPLIES[request.param]
    ids = [*tok.encode(text), tok.tokenizer.token_to_id(stop)]
    f = tok.family
    reasoning = f.stream_reasoning(False) if f.reasoning else None
    tools = f.stream_tools(NAMES)
    sent: list[tuple[int, str, object]] = []

    def to_tools(at: int, text: str, final: bool) -> None:
        for ev in [*(tools.feed(text) if text else []), *(tools.finish() if final else [])]:
            sent.append((at, "content", ev.text) if ev.kind == "content" else (at, "call", (ev.name, ev.arguments)))

    def push(at: int, text: str, final: bool = False) -> None:
        if reasoning is None:
            return to_tools(at, text, final)
        pieces = [*(reasoning.feed(text) if text else []), *(reasoning.finish() if final else [])]
        for p in pieces:
            if p.kind == "reasoning":
                sent.append((at, "reasoning", p.text))
            else:
                to_tools(at, p.text, False)
        if final:
            to_tools(at, "", True)

    decoder = IncrementalDecoder(tok)
    for k, i in enumerate(ids):
        push(k, decoder.push([i]))
    push(len(ids), decoder.flush(), final=True)
    assert tools.status == "ok"
    return tok, ids, sent


def test_what_streamed_equals_the_whole_parse(streamed) -> None:
    tok, ids, sent = streamed
    f = tok.family
    reasoning, rest = f.split_reasoning(tok.decode(ids, skip_special_tokens=True), False)
    whole = f.parse_tools(rest, NAMES)
    assert ("".join(str(p) for _, k, p in sent if k == "content") or None) == whole.content
    assert [p for _, k, p in sent if k == "call"] == [(c["function"]["name"], c["function"]["arguments"])
                                                      for c in whole.calls]
    assert ("".join(str(p) for _, k, p in sent if k == "reasoning") if f.reasoning else None) == reasoning
    assert whole.status == "ok" and whole.calls


def _call_ends(family: str, text: str) -> list[int]:
    """Where each call's syntax ends in the reply's decoded text."""
    if family == "llama3":  # the call object's closing brace, right after its arguments
        return [text.index(a) + len(a) + 1 for a in ARGS]
    if family == "deepseek_v3":
        end = "<｜tool▁call▁end｜>"
        return [i + len(end) for i in range(len(text)) if text.startswith(end, i)]
    return [-1]  # harmony: the call's message ends with the <|call|> stop token, the stream's end


def test_each_call_arrives_with_the_token_that_ends_it(streamed) -> None:
    tok, ids, sent = streamed
    calls = [at for at, k, _ in sent if k == "call"]
    text = tok.decode(ids, skip_special_tokens=True)
    ends = _call_ends(tok.family.name, text)
    assert len(calls) == len(ends)
    for at, end in zip(calls, ends, strict=True):
        if end < 0:  # the stop token ends it: sent when the stream ends
            assert at == len(ids)
            continue
        assert len(tok.decode(ids[:at], skip_special_tokens=True)) < end  # not before its last token
        assert len(tok.decode(ids[: at + 1], skip_special_tokens=True)) >= end  # with it
    if len(calls) > 1:  # the first while the second is still being sampled
        assert calls[0] < calls[1] < len(ids) - 1


def test_content_and_reasoning_stream_before_the_calls(streamed) -> None:
    tok, _, sent = streamed
    first_call = min(at for at, k, _ in sent if k == "call")
    texts = [(at, k) for at, k, p in sent if k in ("content", "reasoning") and p]
    if tok.family.name == "llama3":
        assert texts == []  # the reply is the calls
        return
    assert texts and all(at < first_call for at, _ in texts)
    assert len({at for at, _ in texts}) > 3  # in many deltas, not one held piece
    if tok.family.name == "gpt_oss":
        kinds = [k for _, k in texts]
        assert kinds[0] == "reasoning" and "content" in kinds
        assert "".join(str(p) for _, k, p in sent if k == "content") == "Checking with the calculator."
