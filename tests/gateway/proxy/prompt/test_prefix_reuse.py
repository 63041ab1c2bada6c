"""Per-rollout prefix reuse: exact sampled ids are continued, drift is detected and labelled."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest

from tracegym.gateway.proxy.prompt.prefix_reuse import PrefixCache, PromptPlan
from tracegym.gateway.proxy.prompt.templating import ChatTokenizer
from tracegym.gateway.proxy.prompt.tools import parse_tool_calls
from tracegym.types import CallRecord, ChoiceRecord

END = "<|im_end|>"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOL_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(tiny_model_dir)


class Rollout:
    """Drives a cache the way the chat route does: plan, 'sample', remember."""

    ids = itertools.count()

    def __init__(self, cache: PrefixCache, rid: str = "r1") -> None:
        self.cache, self.rid, self.records = cache, rid, []

    def call(self, request: dict[str, Any], *samples: str | list[int]) -> tuple[PromptPlan, list[dict]]:
        """Plan ``request``; each sample (text, or exact ids) becomes a choice; returns the plan and replies."""
        plan = self.cache.plan_request(self.rid, request)
        choices, replies = [], []
        for i, sample in enumerate(samples):
            out = self.cache.tok.encode(sample) if isinstance(sample, str) else sample
            stop = bool(out) and out[-1] in self.cache.tok.eos_token_ids  # a route strips the stop token
            content, calls = parse_tool_calls(self.cache.tok.decode(out[:-1] if stop else out))
            message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            choices.append(ChoiceRecord(i, out, [0.0] * len(out), "stop" if stop else "length", message))
            replies.append(message)
        record = CallRecord(
            call_id=f"c{next(self.ids)}",
            rollout_id=self.rid,
            operation="chat",
            model="m",
            upstream_kind="sglang",
            request=request,
            choices=choices,
            prompt_ids=plan.prompt_ids,
            drift=plan.drift,
            prefix_len=plan.prefix_len,
        )
        self.records.append(record)
        self.cache.remember(self.rid, record)
        return plan, replies


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assert_reuses(plan: PromptPlan, parent: PromptPlan, output_ids: list[int], parent_id: str) -> None:
    assert plan.parent_call_id == parent_id
    assert plan.prefix_len == len(parent.prompt_ids) + len(output_ids)
    assert plan.prompt_ids[: plan.prefix_len] == parent.prompt_ids + output_ids


def test_second_turn_continues_the_sampled_ids(tok) -> None:
    r = Rollout(PrefixCache(tok))
    msgs = [{"role": "system", "content": "Be brief."}, user("Hi there")]
    p1, (reply,) = r.call({"messages": msgs}, "Hello! How can I help?" + END)
    assert (p1.drift, p1.prefix_len, p1.parent_call_id) == ("none", 0, None)
    assert p1.prompt_ids == tok.apply(msgs) and p1.prompt_text == tok.render(msgs)
    msgs2 = [*msgs, reply, user("Tell me a joke.")]
    p2, _ = r.call({"messages": msgs2}, "No." + END)
    out1 = tok.encode("Hello! How can I help?" + END)
    assert_reuses(p2, p1, out1, r.records[0].call_id)
    assert p2.drift == "clean" and p2.prompt_ids == tok.apply(msgs2)
    # the "\n" after <|im_end|> was never sampled: it starts the new part
    assert (
        tok.decode(p2.prompt_ids[p2.prefix_len :])
        == "\n<|im_start|>user\nTell me a joke.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_ten_turns_stay_clean(tok) -> None:
    r = Rollout(PrefixCache(tok))
    msgs: list[dict] = [user("Count with me.")]
    prev = None
    for turn in range(10):
        sample = f"{turn} and\n\n  {turn + 1} é日本 " + END
        plan, (reply,) = r.call({"messages": msgs}, sample)
        assert plan.prompt_ids == tok.apply(msgs)
        if prev is not None:
            assert plan.drift == "clean"
            assert_reuses(plan, prev[0], prev[1], r.records[-2].call_id)
        prev = (plan, tok.encode(sample))
        msgs = [*msgs, reply, user(f"next {turn}")]


def test_reply_starting_with_a_space_is_realigned_at_the_prompt_boundary(tok) -> None:
    # the re-render tokenizes "assistant\n " with "\n " as one token; the model sampled " " after "\n"
    r = Rollout(PrefixCache(tok))
    msgs = [user("Count")]
    p1, (reply,) = r.call({"messages": msgs}, "  1 2" + END)
    p2, _ = r.call({"messages": [*msgs, reply, user("more")]}, "3" + END)
    assert p2.drift == "realigned"
    assert_reuses(p2, p1, tok.encode("  1 2" + END), r.records[0].call_id)
    assert p2.prompt_ids[p2.prefix_len :] == tok.encode(
        "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tool_call_then_tool_result_is_clean(tok) -> None:
    r = Rollout(PrefixCache(tok))
    msgs = [user("Weather in Paris?")]
    body = {"messages": msgs, "tools": [WEATHER]}
    sample = "Let me check.\n" + TOOL_CALL + END
    p1, (reply,) = r.call(body, sample)
    assert reply["content"] == "Let me check." and reply["tool_calls"][0]["function"]["name"] == "get_weather"
    # the agent echoes the reply in its own way: another id, reordered arguments, extra null keys
    echoed = copy.deepcopy(reply) | {"refusal": None, "content": "Let me check."}
    echoed["tool_calls"][0]["id"] = "call_other"
    echoed["tool_calls"][0]["function"]["arguments"] = '{ "city" : "Paris" }'
    msgs2 = [*msgs, echoed, {"role": "tool", "tool_call_id": "call_other", "content": "21 C"}]
    p2, _ = r.call({"messages": msgs2, "tools": [WEATHER], "tool_choice": "auto"}, "It is 21 C." + END)
    assert p2.drift == "clean"
    assert_reuses(p2, p1, tok.encode(sample), r.records[0].call_id)
    assert p2.prompt_ids == tok.apply(msgs2, tools=[WEATHER])


def test_tool_call_with_other_whitespace_is_realigned_with_exact_ids(tok) -> None:
    r = Rollout(PrefixCache(tok))
    msgs = [user("Weather in Paris?")]
    sample = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>' + END
    p1, (reply,) = r.call({"messages": msgs, "tools": [WEATHER]}, sample)
    msgs2 = [*msgs, reply, {"role": "tool", "tool_call_id": "x", "content": "21 C"}]
    p2, (reply2,) = r.call({"messages": msgs2, "tools": [WEATHER]}, "Warm." + END)
    out = tok.encode(sample)
    assert p2.drift == "realigned"
    assert_reuses(p2, p1, out, r.records[0].call_id)
    suffix = "\n<|im_start|>tool\n<tool_response>\n21 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert p2.prompt_ids[p2.prefix_len :] == tok.encode(suffix)
    assert p2.prompt_ids != tok.apply(msgs2, tools=[WEATHER])
    # the next turn keeps extending the sampled chain and stays realigned (its history differs)
    msgs3 = [*msgs2, reply2, user("Thanks")]
    p3, _ = r.call({"messages": msgs3, "tools": [WEATHER]}, "Bye" + END)
    assert p3.drift == "realigned"
    assert_reuses(p3, p2, tok.encode("Warm." + END), r.records[1].call_id)
    assert (
        tok.decode(p3.prompt_ids[p3.prefix_len :])
        == "\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n"
    )


def test_non_canonical_tokenization_is_realigned(tok) -> None:
    r = Rollout(PrefixCache(tok))
    msgs = [user("Say hello")]
    out = [i for ch in "Hello world" for i in tok.encode(ch)] + tok.encode(END)
    assert tok.decode(out) == "Hello world" + END and out != tok.encode("Hello world" + END)
    p1, (reply,) = r.call({"messages": msgs}, out)
    msgs2 = [*msgs, reply, user("again")]
    p2, _ = r.call({"messages": msgs2}, "ok" + END)
    assert p2.drift == "realigned"
    assert_reuses(p2, p1, out, r.records[0].call_id)
    assert p2.prompt_ids[p2.prefix_len :] == tok.encode(
        "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    )


def test_truncated_reply_gets_the_end_of_turn_in_the_new_part(tok) -> None:
    r = Rollout(PrefixCache(tok))
    msgs = [user("Write a long story")]
    p1, (reply,) = r.call({"messages": msgs}, "Once upon a ti")
    msgs2 = [*msgs, reply, user("go on")]
    p2, _ = r.call({"messages": msgs2}, "me" + END)
    assert p2.drift == "clean" and p2.prompt_ids == tok.apply(msgs2)
    assert_reuses(p2, p1, tok.encode("Once upon a ti"), r.records[0].call_id)
    assert tok.decode(p2.prompt_ids[p2.prefix_len :]).startswith(END + "\n<|im_start|>user\n")


def test_other_stop_token_is_kept_and_the_template_end_follows(tok) -> None:
    r = Rollout(PrefixCache(tok))
    msgs = [user("hi")]
    out = [*tok.encode("Hi"), 0]  # stopped on <|endoftext|>, which the template never writes
    p1, (reply,) = r.call({"messages": msgs}, out)
    assert reply == {"role": "assistant", "content": "Hi"}
    p2, _ = r.call({"messages": [*msgs, reply, user("ok")]}, "k" + END)
    assert p2.drift == "realigned"
    assert_reuses(p2, p1, out, r.records[0].call_id)
    assert (
        tok.decode(p2.prompt_ids[p2.prefix_len :])
        == END + "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
    )
    # an agent that changes the reply forks, whatever the change
    changed = {"role": "assistant", "content": "Hi<|endoftext|>"}
    p3, _ = r.call({"messages": [*msgs, changed, user("ok")]}, "k" + END)
    assert p3.drift == "forked"


def test_edited_reply_forks_and_unrelated_is_none(tok) -> None:
    r = Rollout(PrefixCache(tok))
    msgs = [user("Hi")]
    r.call({"messages": msgs}, "Hello!" + END)
    edited = [*msgs, {"role": "assistant", "content": "Hello (edited)"}, user("more")]
    p2, _ = r.call({"messages": edited}, "x" + END)
    assert (p2.drift, p2.prefix_len, p2.parent_call_id) == ("forked", 0, r.records[0].call_id)
    assert p2.prompt_ids == tok.apply(edited)
    p3, _ = r.call({"messages": [user("Something else")]}, "y" + END)
    assert (p3.drift, p3.prefix_len, p3.parent_call_id) == ("none", 0, None)


def test_dropped_history_forks(tok) -> None:
    r = Rollout(PrefixCache(tok))
    msgs = [{"role": "system", "content": "S"}, user("task")]
    _, (a1,) = r.call({"messages": msgs}, "step one" + END)
    r.call({"messages": [*msgs, a1, user("continue")]}, "step two" + END)
    summarised = [*msgs, user("Summary of earlier steps: ...")]
    p, _ = r.call({"messages": summarised}, "z" + END)
    assert p.drift == "forked" and p.prompt_ids == tok.apply(summarised)


def test_changed_tools_fork_and_same_tools_extend(tok) -> None:
    r = Rollout(PrefixCache(tok))
    msgs = [user("Weather?")]
    _, (reply,) = r.call({"messages": msgs, "tools": [WEATHER]}, "Which city?" + END)
    msgs2 = [*msgs, reply, user("Paris")]
    p, _ = r.call({"messages": msgs2}, "x" + END)  # tools dropped: the system prompt changed
    assert p.drift == "forked" and p.prompt_ids == tok.apply(msgs2)
    p, _ = r.call({"messages": msgs2, "tools": [WEATHER], "tool_choice": "none"}, "x" + END)
    assert p.drift == "forked"
    p, _ = r.call({"messages": msgs2, "tools": [WEATHER]}, "x" + END)
    assert p.drift == "clean" and p.parent_call_id == r.records[0].call_id
    assert p.prompt_ids == tok.apply(msgs2, tools=[WEATHER])


def test_n_choices_the_one_continued_is_reused(tok) -> None:
    r = Rollout(PrefixCache(tok))
    msgs = [user("Pick a number")]
    p1, replies = r.call({"messages": msgs}, "Seven." + END, "Three, maybe." + END, "Seven." + END)
    msgs2 = [*msgs, replies[1], user("why?")]
    p2, _ = r.call({"messages": msgs2}, "Because." + END)
    assert p2.drift == "clean"
    assert_reuses(p2, p1, tok.encode("Three, maybe." + END), r.records[0].call_id)


def test_retry_of_the_same_request_reuses_its_prompt(tok) -> None:
    r = Rollout(PrefixCache(tok))
    out = [i for ch in "Hey" for i in tok.encode(ch)] + tok.encode(END)
    _, (reply,) = r.call({"messages": [user("hi")]}, out)
    msgs2 = [user("hi"), reply, user("again")]
    p2, _ = r.call({"messages": msgs2}, "a" + END)
    p3, _ = r.call({"messages": msgs2}, "b" + END)
    assert p3.prompt_ids == p2.prompt_ids and p3.drift == p2.drift == "realigned"
    assert (p3.parent_call_id, p3.prefix_len) == (r.records[1].call_id, len(p2.prompt_ids))


def test_replan_adds_stored_parents_a_fresh_cache_lacks(tok) -> None:
    first = Rollout(PrefixCache(tok))
    msgs = [user("Weather in Paris?")]
    sample = '<tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>' + END
    _, (a1,) = first.call({"messages": msgs, "tools": [WEATHER]}, sample)
    msgs2 = [*msgs, a1, {"role": "tool", "tool_call_id": "x", "content": "21"}]
    _, (a2,) = first.call({"messages": msgs2, "tools": [WEATHER]}, "21 degrees." + END)
    msgs3 = [*msgs2, a2, user("and tomorrow?")]
    expected = first.cache.plan_request("r1", {"messages": msgs3, "tools": [WEATHER]})
    assert expected.drift == "realigned" and not expected.lookup  # in memory: no lookup

    cache = PrefixCache(tok)  # another gateway, or this one after a restart
    plan = cache.plan_request("r1", {"messages": msgs3, "tools": [WEATHER]})
    assert plan.lookup and plan.drift == "none" and plan.prompt_ids != expected.prompt_ids
    failed = CallRecord("bad", "r1", "chat", "m", "sglang", {"messages": msgs}, [], None, status="error")
    other = CallRecord("odd", "r1", "chat", "m", "sglang", {"messages": "not a list"}, [], [1])
    stored = [failed, other, *reversed(first.records)]  # any order: the deepest parent is taken
    plan = cache.replan("r1", plan, stored)
    assert (plan.prompt_ids, plan.drift, plan.prefix_len, plan.parent_call_id, plan.lookup) == (
        expected.prompt_ids, expected.drift, expected.prefix_len, expected.parent_call_id, False)
    cache.remember("r1", first.records[-1])  # already added: not duplicated
    assert len(cache._rollouts["r1"].calls) == 2
    again = cache.plan_request("r1", {"messages": msgs3, "tools": [WEATHER]})
    assert again.prompt_ids == expected.prompt_ids and not again.lookup


def test_calls_alternating_between_two_caches_stay_one_sequence(tok) -> None:
    """Two gateways on one store, a rollout's calls alternating between them: with ``replan`` on each
    lookup, every prompt continues the previous call's prompt and sampled ids; without it the sampled ids
    of the call the other gateway served are re-tokenized."""
    for lookup in (True, False):
        caches = [PrefixCache(tok), PrefixCache(tok)]
        stored: list[CallRecord] = []
        msgs, prev, broken = [user("Spell hello.")], None, 0
        for turn in range(6):
            r = Rollout(caches[turn % 2])
            plan = r.cache.plan_request("r1", {"messages": msgs})
            if lookup and plan.lookup:
                plan = r.cache.replan("r1", plan, stored)
            out = [i for ch in f"he llo {turn}" for i in tok.encode(ch)] + tok.encode(END)  # not canonical
            if prev is not None and plan.prompt_ids[: len(prev)] != prev:
                broken += 1
            prev = plan.prompt_ids + out
            _, (reply,) = r.call({"messages": msgs}, out)  # plans again from memory: the same plan
            assert r.records[-1].prompt_ids == plan.prompt_ids
            stored.append(r.records[-1])
            msgs = [*msgs, reply, user(f"again {turn}")]
        assert broken == (0 if lookup else 5)


def test_a_turn_the_store_does_not_explain_is_looked_up_once(tok) -> None:
    r = Rollout(PrefixCache(tok))
    shot = [user("2+2?"), {"role": "assistant", "content": "4"}, user("3+3?")]  # the agent wrote the reply
    plan = r.cache.plan_request("r1", {"messages": shot})
    assert plan.lookup
    plan = r.cache.replan("r1", plan, [])
    assert plan.drift == "none" and not plan.lookup and plan.prompt_ids == tok.apply(shot)
    assert not r.cache.plan_request("r1", {"messages": shot}).lookup
    _, (reply,) = r.call({"messages": shot}, "6" + END)
    assert not r.cache.plan_request("r1", {"messages": [*shot, reply, user("4+4?")]}).lookup
    with pytest.raises(ValueError, match="plan_chat"):
        r.cache.replan("r1", PromptPlan([1], "none", 0, None), [])


def test_a_retry_on_another_cache_reuses_the_stored_prompt(tok) -> None:
    a = Rollout(PrefixCache(tok))
    _, (reply,) = a.call({"messages": [user("hi")]}, [i for ch in "Hey" for i in tok.encode(ch)] + tok.encode(END))
    msgs2 = [user("hi"), reply, user("again")]
    p2, _ = a.call({"messages": msgs2}, "a" + END)
    b = PrefixCache(tok)
    plan = b.plan_request("r1", {"messages": msgs2})
    plan = b.replan("r1", plan, a.records)
    assert (plan.prompt_ids, plan.drift, plan.parent_call_id) == (p2.prompt_ids, p2.drift, a.records[1].call_id)


def test_lru_bound_on_rollouts(tok) -> None:
    cache = PrefixCache(tok, max_rollouts=2)
    for rid in ("a", "b", "c"):
        Rollout(cache, rid).call({"messages": [user(rid)]}, "ok" + END)
    assert len(cache) == 2 and "a" not in cache and {"b", "c"} <= {k for k in ("a", "b", "c") if k in cache}
    cache.plan_request("b", {"messages": [user("b")]})  # b is now the most recent
    Rollout(cache, "d").call({"messages": [user("d")]}, "ok" + END)
    assert "c" not in cache and "b" in cache and "d" in cache
    # an evicted rollout starts over: its next turn is no longer recognised (no loader)
    msgs = [user("a"), {"role": "assistant", "content": "ok"}, user("more")]
    assert cache.plan_request("a", {"messages": msgs}).drift == "none"
    with pytest.raises(ValueError):
        PrefixCache(tok, max_rollouts=0)


def test_calls_per_rollout_are_bounded(tok) -> None:
    r = Rollout(PrefixCache(tok, max_calls_per_rollout=2))
    _, (a1,) = r.call({"messages": [user("first")]}, "one" + END)
    r.call({"messages": [user("second")]}, "two" + END)
    r.call({"messages": [user("third")]}, "three" + END)
    p, _ = r.call({"messages": [user("first"), a1, user("again")]}, "x" + END)
    assert p.drift == "none"  # the first call was dropped
    # a call remembered twice is kept once; one that was dropped can come back (the id set follows the deque)
    r.cache.remember("r1", r.records[-1])
    r.cache.remember("r1", r.records[0])
    p, _ = r.call({"messages": [user("first"), a1, user("again")]}, "x" + END)
    assert p.drift == "clean" and p.parent_call_id == r.records[0].call_id


def test_failed_and_tokenless_calls_are_not_parents(tok) -> None:
    cache = PrefixCache(tok)
    msgs = [user("hi")]
    reply = {"role": "assistant", "content": "yo"}
    for kwargs in ({"status": "error"}, {"prompt_ids": None}):
        fields = {"prompt_ids": tok.apply(msgs), **kwargs}
        choice = ChoiceRecord(0, tok.encode("yo" + END), None, "stop", reply)
        cache.remember(
            "r", CallRecord("c", "r", "chat", "m", "litellm", {"messages": msgs}, [choice], **fields)
        )
    assert cache.plan_request("r", {"messages": [*msgs, reply, user("x")]}).drift == "none"


def _scenario(cache: PrefixCache) -> list[PromptPlan]:
    r = Rollout(cache)
    plans = []
    msgs: list[dict] = [{"role": "system", "content": "S"}, user("Weather in Paris?")]
    samples = [
        TOOL_CALL + END,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' + END,
        "Sunny, " * 5 + END,
        "trunc",
    ]
    for i, sample in enumerate(samples):
        plan, (reply,) = r.call({"messages": msgs, "tools": [WEATHER]}, sample)
        plans.append(plan)
        nxt = {"role": "tool", "content": f"{i}"} if "tool_calls" in reply else user(f"q{i}")
        msgs = [*msgs, reply, nxt]
    plans.append(cache.plan_request("r1", {"messages": msgs, "tools": [WEATHER]}))
    return plans


def test_fast_drift_check_equals_tokenizing_whole(tok) -> None:
    fast, full = _scenario(PrefixCache(tok)), _scenario(PrefixCache(tok, full_check=True))
    assert [p.drift for p in fast] == ["none", "clean", "realigned", "realigned", "realigned"]
    assert [(p.prompt_ids, p.drift, p.prefix_len) for p in fast] == [
        (p.prompt_ids, p.drift, p.prefix_len) for p in full
    ]
