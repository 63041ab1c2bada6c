"""Prefix reuse under Qwen3's real chat template (``qwen3-tiny``), which rewrites earlier turns: the
``<think>`` block of every assistant turn before the last user message is dropped, tool calls are written
as ``<tool_call>\\n{json}\\n</tool_call>``, and ``enable_thinking: false`` puts an empty think block in the
generation prompt that later renders drop. Whatever the template does to history, each call's prompt must
start with the parent's exact prompt + sampled ids (reasoning included), the rewrite is labelled
``realigned`` (never ``forked`` or hidden), and the appended part is the re-render after the reply."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from tests.shared_tokenizers import ONE_WORKER, chat_tokenizer
from tracegym.gateway.proxy.prompt.prefix_reuse import PrefixCache, PromptPlan
from tracegym.gateway.proxy.prompt.reasoning import split_reasoning
from tracegym.gateway.proxy.prompt.templating import ChatTokenizer
from tracegym.gateway.proxy.prompt.tools import parse_tools
from tracegym.types import CallRecord, ChoiceRecord

pytestmark = ONE_WORKER

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
CANONICAL_CALL = '<think>\nI add them.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
SLOPPY_CALL = '<think>I add them.</think>\nOK.<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
ANSWER = "<think>\nThe tool said 5.\n</think>\n\nIt is 5."


@pytest.fixture(scope="module")
def tok(qwen3_model_dir: Path) -> ChatTokenizer:
    return chat_tokenizer(qwen3_model_dir)


class Chat:
    """A chat client of one rollout, as the chat route records its calls (reasoning split off as
    ``reasoning_content``, tool calls parsed); ``send_back`` says how the client returns each reply."""

    ids = itertools.count()

    def __init__(self, tok: ChatTokenizer, *, send_back: str = "reasoning_content", **request: Any) -> None:
        self.cache, self.send_back, self.request = PrefixCache(tok), send_back, request
        self.messages: list[dict[str, Any]] = []
        self.plans: list[PromptPlan] = []
        self.outputs: list[list[int]] = []

    def turn(self, *new: dict[str, Any], sample: str) -> PromptPlan:
        self.messages += new
        plan = self.cache.plan_request("r", {"messages": list(self.messages), **self.request})
        tok = self.cache.tok
        out = [*tok.encode(sample), tok.eos_token_ids[0]]  # the engine stops on <|im_end|>
        reasoning, text = split_reasoning(sample)
        parsed = parse_tools(text, None)
        reply: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if reasoning is not None:
            reply["reasoning_content"] = reasoning
        if parsed.calls:
            reply["tool_calls"] = parsed.calls
        record = CallRecord(call_id=f"c{next(self.ids)}", rollout_id="r", operation="chat", model="m",
                            upstream_kind="sglang", request={"messages": list(self.messages), **self.request},
                            choices=[ChoiceRecord(0, out, [0.0] * len(out), "stop", reply)],
                            prompt_ids=plan.prompt_ids, drift=plan.drift, prefix_len=plan.prefix_len)
        self.cache.remember("r", record)
        if self.send_back == "content":  # the reasoning written back into the content
            reply = {**{k: v for k, v in reply.items() if k != "reasoning_content"}, "content": sample
                     if not parsed.calls else (f"<think>\n{reasoning}\n</think>\n\n{parsed.content or ''}")}
        elif self.send_back == "dropped":  # clients (LangChain) that drop it
            reply = {k: v for k, v in reply.items() if k != "reasoning_content"}
        self.messages.append(reply)
        self.plans.append(plan)
        self.outputs.append(out)
        return plan

    def check_one_sequence(self) -> None:
        """Every call's prompt is the previous call's prompt + sampled ids + new ids: one sequence."""
        for prev, out, plan in zip(self.plans, self.outputs, self.plans[1:], strict=False):
            assert plan.prompt_ids[: len(prev.prompt_ids) + len(out)] == prev.prompt_ids + out
            assert plan.prefix_len == len(prev.prompt_ids) + len(out)


def _tail(tok: ChatTokenizer, plan: PromptPlan) -> str:
    return tok.decode(plan.prompt_ids[plan.prefix_len :])


@pytest.mark.parametrize("send_back", ["reasoning_content", "content", "dropped"])
def test_tool_loop_then_new_user_turn_keeps_every_sampled_think(tok: ChatTokenizer, send_back: str) -> None:
    chat = Chat(tok, send_back=send_back, tools=[ADD])
    chat.turn({"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"},
              sample=SLOPPY_CALL)
    call_id = chat.messages[-1]["tool_calls"][0]["id"]
    two = chat.turn({"role": "tool", "tool_call_id": call_id, "content": "5"}, sample=ANSWER)
    three = chat.turn({"role": "user", "content": "And 3+4?"}, sample=CANONICAL_CALL)
    call_id = chat.messages[-1]["tool_calls"][0]["id"]
    four = chat.turn({"role": "tool", "tool_call_id": call_id, "content": "7"}, sample=ANSWER)
    chat.check_one_sequence()
    # realigned throughout: each prompt holds sampled reasoning that the template's re-render drops
    assert [p.drift for p in chat.plans] == ["none", "realigned", "realigned", "realigned"]
    # the appended ids are exactly what Qwen3 renders after each reply
    assert _tail(tok, two) == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert _tail(tok, three) == "\n<|im_start|>user\nAnd 3+4?<|im_end|>\n<|im_start|>assistant\n"
    assert _tail(tok, four) == "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # the sampled reasoning of every turn is in the last prompt, though the re-render dropped it
    full = tok.decode(four.prompt_ids)
    assert full.count("I add them.") == 2 and full.count("The tool said 5.") == 1
    rerender = tok.render(chat.messages[:-1], tools=[ADD])
    assert "I add them." not in rerender.split("And 3+4?")[0]


def test_canonical_replies_in_a_tool_loop_are_clean(tok: ChatTokenizer) -> None:
    """A reply written exactly as Qwen3's template renders it (reasoning kept after the last user turn)
    re-renders to its own sampled text: nothing to realign."""
    chat = Chat(tok, tools=[ADD])
    chat.turn({"role": "user", "content": "2+3?"}, sample=CANONICAL_CALL)
    call_id = chat.messages[-1]["tool_calls"][0]["id"]
    chat.turn({"role": "tool", "tool_call_id": call_id, "content": "5"}, sample=ANSWER)
    chat.check_one_sequence()
    assert [p.drift for p in chat.plans] == ["none", "clean"]
    assert chat.plans[1].prompt_ids == tok.encode(chat.plans[1].prompt_text)


def test_enable_thinking_false_empty_think_is_dropped_by_later_renders(tok: ChatTokenizer) -> None:
    chat = Chat(tok, chat_template_kwargs={"enable_thinking": False})
    one = chat.turn({"role": "user", "content": "Hi"}, sample="Hello.")
    assert tok.decode(one.prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    two = chat.turn({"role": "user", "content": "2+3?"}, sample="5.")
    chat.check_one_sequence()
    assert two.drift == "realigned" and "<think>\n\n</think>" not in two.prompt_text.split("2+3?")[0]
    assert _tail(tok, two) == "\n<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_an_edited_reply_still_forks(tok: ChatTokenizer) -> None:
    chat = Chat(tok)
    chat.turn({"role": "user", "content": "Hi"}, sample=ANSWER)
    chat.messages[-1] = {"role": "assistant", "content": "Something else."}
    plan = chat.turn({"role": "user", "content": "Again"}, sample="x")
    assert plan.drift == "forked" and plan.prompt_ids == tok.encode(plan.prompt_text)
