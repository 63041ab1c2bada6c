"""Conformance of every model family on its tiny model (the family's real tokenizer and template): the
gateway's rendering of OpenAI-shaped conversations equals transformers' ``apply_chat_template`` of the
same conversations written as the official template documents them, token for token, over a seeded
corpus; and every tool call a family's model writes parses back and renders into the next turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.gateway.proxy.prompt import family_corpus as corpus
from tests.shared_tokenizers import ONE_WORKER, chat_tokenizer, hf_tokenizer
from tracegym.gateway.proxy.prompt.templating import ChatTokenizer

pytestmark = ONE_WORKER

MODELS = {"chatml": "tiny-random", "qwen3": "qwen3-tiny", "llama3": "llama3-tiny", "gemma3": "gemma3-tiny",
          "deepseek_v3": "deepseek3-tiny", "gpt_oss": "gptoss-tiny"}
CONVERSATIONS = 200
NAMES = [t["function"]["name"] for t in corpus.TOOLS]


@pytest.fixture(params=list(MODELS))
def family(request: pytest.FixtureRequest) -> tuple[str, Path]:
    """A family's name and its tiny model (prepared once per machine, found again in microseconds): not
    module-scoped, so that its 36 tests spread over the workers of ``pytest -n``; the tests read the
    family's tokenizers from ``tests.shared_tokenizers`` (loaded once per worker)."""
    from tracegym.modelfiles.prepare import prepare_model

    return request.param, prepare_model(MODELS[request.param])


def _ids(hf_out: object) -> list[int]:
    return list(hf_out["input_ids"] if hasattr(hf_out, "keys") else hf_out)  # type: ignore[index]


def _reference(name: str, hf: object, messages: list[dict], tools: list | None) -> list[int]:
    """transformers' rendering with the model's template. DeepSeek V3's template tells a tool-calling turn by
    ``content`` being null, a key ``apply_chat_template`` (transformers 5) drops before rendering, which
    makes the template fail on every such turn; there the template is rendered by transformers' own jinja
    environment on the messages as given (as SGLang and vLLM pass them), then tokenized by transformers."""
    if name != "deepseek_v3":
        return _ids(hf.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True))
    from transformers.utils.chat_template_utils import _compile_jinja_template

    text = _compile_jinja_template(hf.chat_template).render(
        messages=messages, tools=tools, add_generation_prompt=True, **hf.special_tokens_map)
    return list(hf.encode(text, add_special_tokens=False))


def test_corpus_renders_token_for_token(family: tuple[str, Path]) -> None:
    name, d = family
    ours, hf = chat_tokenizer(d), hf_tokenizer(d)
    assert ours.family.name == name
    f = ours.family
    mismatches, kinds = [], {"tool_calls": 0, "parallel": 0, "tool_results": 0, "reasoning": 0, "long": 0}
    for seed in range(CONVERSATIONS):
        turns, offered = corpus.conversation(seed, parallel=f.parallel_calls, reasoning=f.reasoning is not None,
                                             tools=True)
        kinds["tool_calls"] += any(t.calls for t in turns)
        kinds["parallel"] += any(len(t.calls) > 1 for t in turns)
        kinds["tool_results"] += any(t.role == "tool" for t in turns)
        kinds["reasoning"] += any(t.reasoning is not None for t in turns)
        kinds["long"] += len(turns) >= 12
        messages, tools = corpus.native(name, turns, offered)
        expected = _reference(name, hf, messages, tools)
        got = ours.apply(corpus.openai(turns), tools=corpus.TOOLS if offered else None)
        if got != expected:
            mismatches.append(seed)
    assert mismatches == [], f"{name}: {len(mismatches)} of {CONVERSATIONS} differ, seeds {mismatches[:10]}"
    assert kinds["tool_calls"] > 40 and kinds["tool_results"] > 40 and kinds["long"] > 10
    assert kinds["parallel"] > 10 or not f.parallel_calls
    assert kinds["reasoning"] > 20 or f.reasoning is None


def test_sampled_calls_parse_and_render_into_the_next_turn(family: tuple[str, Path]) -> None:
    """A reply in the family's syntax parses to the calls it names (arguments equal as JSON), and the next
    turn's render, with those calls in the history, continues the prompt with the reply as the model wrote
    it (DeepSeek V3's template renders later call turns differently: there the calls must survive)."""
    import json

    name, d = family
    ours = chat_tokenizer(d)
    f = ours.family
    checked = 0
    for seed in range(60):
        turns, offered = corpus.conversation(seed, parallel=f.parallel_calls, reasoning=False, tools=True)
        for i, t in enumerate(turns):
            if not t.calls:
                continue
            text = corpus.sampled(name, "", t.calls)
            _, rest = f.split_reasoning(text, False)
            parsed = f.parse_tools(rest, NAMES)
            assert parsed.status == "ok", (name, text, parsed.status)
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.calls] == [
                (c.name, c.args) for c in t.calls]
            history = corpus.openai(turns[:i])
            reply = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.calls}
            results = [{"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in parsed.calls]
            prompt = ours.render(history, tools=corpus.TOOLS if offered else None)
            after = ours.render([*history, reply, *results], tools=corpus.TOOLS if offered else None)
            if name == "deepseek_v3":  # a later call turn loses its <｜Assistant｜> in the template's render
                assert all(f"<｜tool▁sep｜>{c.name}\n```json\n" in after for c in t.calls)
            else:
                assert after.startswith(prompt), name
                assert after[len(prompt):].startswith(text), (name, after[len(prompt):][:200], text)
            checked += 1
    assert checked > 20


def test_malformed_calls_are_never_silent(family: tuple[str, Path]) -> None:
    """Output that looks like the family's call syntax but does not parse is content with a failed status;
    a call naming a tool that was not offered fails too."""
    name, d = family
    f = chat_tokenizer(d).family
    good = corpus.sampled(name, "", [corpus.Call("c", "add", {"a": 1, "b": 2})])
    unknown = good.replace("add", "rm_rf")
    bad_json = good.replace('{"a": 1, "b": 2}', '{"a": 1, "b": ')
    for text, reason in ((unknown, "unknown tool"), (bad_json, "")):
        _, rest = f.split_reasoning(text, False)
        parsed = f.parse_tools(rest, NAMES)
        assert parsed.status.startswith("failed"), (name, text, parsed.status)
        assert reason in parsed.status
        assert parsed.calls == [] and parsed.content
    plain = f.parse_tools("just words", NAMES)
    assert plain.status == "none" and plain.content == "just words"


def test_rollouts_keep_the_sampled_ids(family: tuple[str, Path]) -> None:
    """Corpus conversations played as rollouts (``benchmarks/drift.py``): every call's prompt starts with
    the previous call's prompt + sampled ids, whatever the family's template does to history."""
    from benchmarks.drift import play
    from tracegym.gateway.proxy.prompt.prefix_reuse import PrefixCache

    name, d = family
    tok = chat_tokenizer(d)
    cache = PrefixCache(tok)
    totals = [play(tok, seed, cache)[:3] for seed in range(40)]
    calls, _, wrong = (sum(t[i] for t in totals) for i in range(3))
    assert calls > 100 and wrong == 0, name


def test_the_ways_to_realign_a_reply_plan_the_same(family: tuple[str, Path]) -> None:
    """A reply that re-renders differently is realigned after its text without the reasoning when the
    re-render has that where the reply was (Qwen3), or after the text its family says the template writes
    back for it (gpt-oss's final answers, and its calls whose analysis was empty), else by whichever of a
    probe standing for the reply and the parent conversation re-rendered worked last: over corpus rollouts, a
    cache that only ever tries the probe first, one that only ever tries the parent render first (both
    without those shortcuts) and the gateway's plan every call alike."""
    from benchmarks.drift import play
    from tracegym.gateway.proxy.prompt.prefix_reuse import PrefixCache

    class Fixed(PrefixCache):
        def __init__(self, tok: ChatTokenizer, probe_first: bool) -> None:
            super().__init__(tok)
            self.fixed = probe_first

        @property  # type: ignore[override]
        def _probe_first(self) -> bool:
            return self.fixed

        @_probe_first.setter
        def _probe_first(self, value: bool) -> None:
            pass

        def _choice(self, *args: Any) -> Any:
            choice = super()._choice(*args)
            choice.bare_text = choice.written = None
            return choice

    name, d = family
    tok = chat_tokenizer(d)
    caches = [PrefixCache(tok), Fixed(tok, True), Fixed(tok, False)]
    for seed in range(25):
        plans: list[list[tuple[list[int], str]]] = [[] for _ in caches]
        for cache, out in zip(caches, plans, strict=True):
            play(tok, seed, cache, out)
        assert plans[0] == plans[1] == plans[2], (name, seed)


def test_an_edited_earlier_turn_is_a_recorded_branch(family: tuple[str, Path]) -> None:
    """The agent sends back a reply other than the one sampled: the call starts a new sequence (``forked``)
    naming the call it branched from, never a silent re-render."""
    from tracegym.gateway.proxy.prompt.prefix_reuse import PrefixCache
    from tracegym.types import CallRecord, ChoiceRecord

    name, d = family
    tok = chat_tokenizer(d)
    cache = PrefixCache(tok)
    msgs = [{"role": "user", "content": "Hello!"}]
    plan = cache.plan_request("r", {"messages": list(msgs)})
    text = corpus.sampled(name, "Hi there.", [])
    out = [*tok.encode(text), tok.eos_token_ids[0]]
    _, rest = tok.family.split_reasoning(text, False)
    reply = {"role": "assistant", "content": tok.family.parse_tools(rest, None).content}
    cache.remember("r", CallRecord(call_id="c0", rollout_id="r", operation="chat", model="m", upstream_kind="sglang",
                                   request={"messages": list(msgs)},
                                   choices=[ChoiceRecord(0, out, [0.0] * len(out), "stop", reply)],
                                   prompt_ids=plan.prompt_ids, drift=plan.drift, prefix_len=plan.prefix_len))
    same = cache.plan_request("r", {"messages": [*msgs, reply, {"role": "user", "content": "More."}]})
    assert same.drift in ("clean", "realigned") and same.parent_call_id == "c0"
    assert same.prompt_ids[: len(plan.prompt_ids) + len(out)] == plan.prompt_ids + out
    edited = cache.plan_request("r", {"messages": [*msgs, {"role": "assistant", "content": "Edited."},
                                                    {"role": "user", "content": "More."}]})
    assert edited.drift == "forked" and edited.parent_call_id == "c0", name
    assert edited.prompt_ids == tok.apply([*msgs, {"role": "assistant", "content": "Edited."},
                                           {"role": "user", "content": "More."}])
