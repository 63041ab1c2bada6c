"""Model families: recognition (and its clear failure), the per-family parsers on whole and streamed
replies, and decoding that keeps a family's structural special tokens."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.proxy.prompt import family_corpus as corpus
from tests.shared_tokenizers import ONE_WORKER, chat_tokenizer
from tracegym.gateway.proxy.prompt.families import FAMILIES, UnknownChatFormat, detect, family
from tracegym.gateway.proxy.prompt.templating import ChatTokenizer

pytestmark = ONE_WORKER

NAMES = [t["function"]["name"] for t in corpus.TOOLS]
CALLS = [corpus.Call("a", "add", {"a": 1, "b": 2.5}), corpus.Call("b", "search", {"query": "熊猫"})]


def test_unknown_tokenizer_is_a_clear_error_and_an_override_works(tiny_model_dir: Path) -> None:
    base = ChatTokenizer.from_dir(tiny_model_dir)
    assert base.family.name == "chatml"
    with pytest.raises(UnknownChatFormat, match=r"looked for .*<\|channel\|> \(gpt_oss\).*chatml"):
        detect("{{ messages[0].content }}", {"<s>", "</s>"}, where="/models/x")
    with pytest.raises(UnknownChatFormat, match="the families are: gpt_oss, deepseek_v3"):
        family("mistral")
    forced = ChatTokenizer(base.tokenizer, base.templates, base.special_tokens, chat_format="llama3")
    assert forced.family is FAMILIES["llama3"]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_streamed_parse_equals_whole_parse(name: str) -> None:
    f = FAMILIES[name]
    calls = CALLS if f.parallel_calls else CALLS[:1]
    rng = random.Random(0)
    for text in (corpus.sampled(name, "", calls), corpus.sampled(name, "Sure.", []), "plain words <b>",
                 corpus.sampled(name, "", calls).replace("add", "nope")):
        _, rest = f.split_reasoning(text, False)
        whole = f.parse_tools(rest, NAMES)
        for _ in range(5):
            parser, content, streamed = f.stream_tools(NAMES), "", []
            pos = 0
            while pos < len(rest):
                step = rng.randint(1, 7)
                for ev in parser.feed(rest[pos:pos + step]):
                    if ev.kind == "content":
                        content += ev.text
                    else:
                        streamed.append((ev.name, ev.arguments))
                pos += step
            for ev in parser.finish():
                if ev.kind == "content":
                    content += ev.text
                else:
                    streamed.append((ev.name, ev.arguments))
            assert parser.status == whole.status, (name, text)
            assert streamed == [(c["function"]["name"], c["function"]["arguments"]) for c in whole.calls]
            assert (content or None) == whole.content, (name, text, content)


def test_llama3_python_tag_and_semicolon_separated_calls() -> None:
    f = FAMILIES["llama3"]
    p = f.parse_tools('<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "search", "arguments": '
                      '{"query": "x"}}', NAMES)
    assert p.status == "ok" and [c["function"]["name"] for c in p.calls] == ["add", "search"] and p.content is None
    assert f.parse_tools('{"name": "add", "parameters": {"a": 1}} trailing', NAMES).status.startswith("failed")
    assert f.parse_tools('{"name": "add", "parameters": "not json"}', NAMES).status == (
        "failed: arguments are not JSON")
    assert f.parse_tools("The answer is {1}.", NAMES).status == "none"


def test_deepseek_content_before_calls_and_unterminated_call() -> None:
    f = FAMILIES["deepseek_v3"]
    text = corpus.sampled("deepseek_v3", "Let me check.", CALLS)
    p = f.parse_tools(text, NAMES)
    assert p.status == "ok" and p.content == "Let me check." and len(p.calls) == 2
    assert p.calls[0]["function"]["arguments"] == '{"a": 1, "b": 2.5}'  # as sampled
    cut = text[: text.index("```<｜tool▁call▁end｜>")]
    assert f.parse_tools(cut, NAMES).status.startswith("failed: unterminated")


def test_harmony_channels() -> None:
    f = FAMILIES["gpt_oss"]
    text = ("<|channel|>analysis<|message|>think π<|end|><|start|>assistant<|channel|>commentary<|message|>"
            "Checking.<|end|><|start|>assistant to=functions.add<|channel|>commentary <|constrain|>json"
            '<|message|>{"a": 1}')
    reasoning, rest = f.split_reasoning(text, False)
    assert reasoning == "think π"
    p = f.parse_tools(rest, NAMES)
    assert p.status == "ok" and p.content == "Checking." and p.calls[0]["function"]["name"] == "add"
    final = f.parse_tools("<|channel|>final<|message|>Hi there", NAMES)
    assert final.content == "Hi there" and final.status == "none"
    browser = f.parse_tools('<|channel|>commentary to=browser.search<|message|>{"q": 1}', NAMES)
    assert browser.status == "failed: recipient 'browser.search' is not a function"
    never_closed, rest = f.split_reasoning("<|channel|>analysis<|message|>still thinking", False)
    assert never_closed == "still thinking" and rest == ""


def test_gpt_oss_decode_keeps_the_harmony_tokens() -> None:
    tok = chat_tokenizer("gptoss-tiny")
    ids = tok.encode("<|channel|>final<|message|>Hi<|return|>")
    assert tok.decode(ids, skip_special_tokens=True) == "<|channel|>final<|message|>Hi"
    assert tok.decode(ids) == "<|channel|>final<|message|>Hi<|return|>"
    assert tok.reasoning and 200012 in tok.eos_token_ids


def test_templates_that_raise_are_render_errors() -> None:
    from tracegym.gateway.proxy.prompt.templating import TemplateRenderError

    gemma = chat_tokenizer("gemma3-tiny")
    with pytest.raises(TemplateRenderError, match="roles must alternate"):
        gemma.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    oss = chat_tokenizer("gptoss-tiny")
    with pytest.raises(TemplateRenderError, match="no previous assistant message with a tool call"):
        oss.render([{"role": "user", "content": "a"}, {"role": "tool", "tool_call_id": "x", "content": "5"}])
    llama = chat_tokenizer("llama3-tiny")
    with pytest.raises(TemplateRenderError, match="no first user message"):
        llama.render([{"role": "system", "content": "s"}], tools=corpus.TOOLS)


def test_a_whole_reply_parser_streams_through_the_buffered_parser() -> None:
    """``BufferedToolParser`` (for a family with only a whole-reply parser): text streams until the syntax
    may start, then the reply is held and parsed whole; what streamed equals the whole parse."""
    from tracegym.gateway.proxy.prompt.families import BufferedToolParser
    from tracegym.gateway.proxy.prompt.tools import parse_tools

    text = "Let me add.\n" + corpus.sampled("chatml", "", CALLS[:1])
    for at_start, reply in ((False, text), (True, corpus.sampled("chatml", "", CALLS))):
        parser, sent = BufferedToolParser(parse_tools, ("<tool_call>",), NAMES, at_start=at_start), []
        for i in range(0, len(reply), 3):
            sent += [(ev.kind, ev.text or ev.name) for ev in parser.feed(reply[i:i + 3])]
        held = len(sent)
        sent += [(ev.kind, ev.text or ev.name) for ev in parser.finish()]
        whole = parse_tools(reply, NAMES)
        assert "".join(t for k, t in sent if k == "content") == (whole.content or "")
        assert [t for k, t in sent if k == "tool_call"] == [c["function"]["name"] for c in whole.calls]
        assert parser.status == "ok" and (held > 0) == (not at_start)  # content before the call streamed



def fed_in_chunks(reader: Any, text: str, rng: random.Random) -> list:
    """What a streaming reader yields for ``text`` fed in random chunks of 1-6 characters, then finished."""
    out, at = [], 0
    while at < len(text):
        step = rng.randint(1, 6)
        out += reader.feed(text[at:at + step])
        at += step
    return out + reader.finish()


def test_harmony_readers_read_a_whole_reply_as_they_stream_it() -> None:
    """``read`` (a whole reply in one pass, what ``split_reasoning`` and ``parse_tools`` use) gives the text the
    readers stream when fed the same reply in pieces: reasoning, text, content, calls and status alike."""
    from tracegym.gateway.proxy.prompt.families.harmony import HarmonyReasoning, HarmonyTools

    rng = random.Random(1)
    replies = [corpus.sampled("gpt_oss", t, c, r) for t in ("", "Sure.", "a<|b") for c in ([], CALLS[:1])
               for r in (None, "", "π\nso")]
    replies += ["  ", " plain <think>x</think> y", "<think>why</think>so", "<|channel|>final<|message|>a<|end|>tail"
                "<|start|>assistant<|channel|>commentary<|message|>b<|return|>", "<|channel|>analysis<|message|>x<|"
                "start|>", " to=functions.add<|channel|>commentary json<|message|>{\"a\": 1", "<|start|>header only",
                "<|channel|>weird<|message|>skip<|end|>  <|start|>assistant<|channel|>final<|message|>", "<|message|>",
                "<|channel|>commentary to=browser.x<|message|>{}<|call|>", "<|channel|>final<|message|>x<|en"]

    def joined(deltas: list, kind: str) -> str:
        return "".join(d.text or "" for d in deltas if d.kind == kind)

    for text in replies:
        for opens in (False, True):
            whole = HarmonyReasoning(opens).read(text)
            for _ in range(4):
                deltas = fed_in_chunks(HarmonyReasoning(opens), text, rng)
                assert [joined(deltas, k) for k in ("reasoning", "text")] == [
                    joined(whole, k) for k in ("reasoning", "text")], text
        reader = HarmonyTools(NAMES)
        whole = reader.read(text)
        for _ in range(4):
            t = HarmonyTools(NAMES)
            events = fed_in_chunks(t, text, rng)
            assert joined(events, "content") == joined(whole, "content") and t.status == reader.status, text
            assert [(e.name, e.arguments) for e in events if e.kind == "tool_call"] == [
                (e.name, e.arguments) for e in whole if e.kind == "tool_call"], text
