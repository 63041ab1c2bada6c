"""Every model family served end to end: ``tracegym serve --engine embedded`` on each family's tiny model
(its real tokenizer and chat template, random weights), through the official ``openai`` (chat, streamed
chat, Responses) and ``anthropic`` (Messages) clients: multi-turn conversations with tools offered and a
tool call in the history merge into one sequence whose mask-1 tokens are exactly the engine's output ids,
and the call's tool-parse status is recorded on every span."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from tests.gateway.app_support import check_one_merged_sequence
from tests.procs import ManagedProcess, free_port, start_process

FAMILY_MODELS = ["llama3-tiny", "gemma3-tiny", "deepseek3-tiny", "gptoss-tiny"]
PARAMS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add", "parameters": PARAMS}}]
GREEDY = {"temperature": 0.0, "max_tokens": 6}


@pytest.fixture(scope="module", params=FAMILY_MODELS)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, ManagedProcess]]:
    from tracegym.modelfiles.prepare import prepare_model

    model = str(prepare_model(request.param))
    tmp, port = tmp_path_factory.mktemp(request.param), free_port()
    argv = ["tracegym", "serve", "--engine", "embedded", "--model", model, "--port", str(port),
            "--store", f"sqlite:///{tmp / 'tracegym.db'}"]
    with start_process(argv, port=port, log_path=tmp / "gateway.log", health_path="/healthz", timeout=240) as gw:
        yield model, gw


def test_chat_streamed_chat_and_a_tool_call_history(served: tuple[str, ManagedProcess]) -> None:
    model, gw = served
    c = openai.OpenAI(base_url=f"{gw.base_url}/rollouts/fam-chat/v1", api_key="unused", max_retries=0, timeout=120)
    msgs: list = [{"role": "system", "content": "Use add. ✓"}, {"role": "user", "content": "2+3? é"}]
    one = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, **GREEDY)
    # the agent goes on as if the model had called add (a client-made call, then its result)
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    msgs += [one.choices[0].message.model_dump(exclude_none=True),
             {"role": "user", "content": "Call add."},
             {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    chunks = list(c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, stream=True, **GREEDY))
    assert chunks[-1].choices == [] or chunks[-1].choices[0].finish_reason is not None
    spans = check_one_merged_sequence(gw.base_url, "fam-chat", [one.id, chunks[0].id])
    assert all(s["attributes"].get("tracegym.tool_parse") in ("ok", "none") or
               s["attributes"]["tracegym.tool_parse"].startswith("failed") for s in spans)
    assert spans[1]["attributes"]["tracegym.drift"] in ("clean", "realigned")


def test_responses_chain(served: tuple[str, ManagedProcess]) -> None:
    model, gw = served
    c = openai.OpenAI(base_url=f"{gw.base_url}/rollouts/fam-resp/v1", api_key="unused", max_retries=0, timeout=120)
    tools = [{"type": "function", "name": "add", "parameters": PARAMS}]
    one = c.responses.create(model=model, input="2+3?", tools=tools, temperature=0.0, max_output_tokens=6)
    two = c.responses.create(model=model, previous_response_id=one.id, input="Again?", tools=tools,
                             temperature=0.0, max_output_tokens=6)
    check_one_merged_sequence(gw.base_url, "fam-resp", [one.id, two.id])


def test_messages_streamed(served: tuple[str, ManagedProcess]) -> None:
    model, gw = served
    c = anthropic.Anthropic(base_url=f"{gw.base_url}/rollouts/fam-msg", api_key="unused", max_retries=0,
                            timeout=120)
    kw = {"model": model, "max_tokens": 6, "tools": [{"name": "add", "input_schema": PARAMS}]}
    msgs: list = [{"role": "user", "content": "2+3?"}]
    one = c.messages.create(messages=msgs, **kw)
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in one.content]},
             {"role": "user", "content": "Again?"}]
    with c.messages.stream(messages=msgs, **kw) as s:
        two = s.get_final_message()
    check_one_merged_sequence(gw.base_url, "fam-msg", [one.id, two.id])


# ------------------------------------------------------------------------------ sampled tool calls

F = {"type": "object", "properties": {}}


@pytest.fixture(scope="module", params=["llama3-tiny", "gptoss-tiny"])
def scripted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[str, list[int], ManagedProcess]]:
    """The family's scripted model (``scripted_family.py``: it writes a call to ``f`` in the family's
    syntax) served by the embedded engine."""
    from tests.e2e.scripted_family import build_scripted_family
    from tracegym.modelfiles.prepare import prepare_model

    tmp = tmp_path_factory.mktemp(f"scripted-{request.param}")
    reply_ids = build_scripted_family(request.param, prepare_model(request.param), tmp / "model")
    port = free_port()
    argv = ["tracegym", "serve", "--engine", "embedded", "--model", str(tmp / "model"), "--port", str(port),
            "--store", f"sqlite:///{tmp / 'tracegym.db'}"]
    with start_process(argv, port=port, log_path=tmp / "gateway.log", health_path="/healthz", timeout=240) as gw:
        yield str(tmp / "model"), reply_ids, gw


def test_sampled_calls_through_the_three_apis(scripted: tuple[str, list[int], ManagedProcess]) -> None:
    """The model writes its family's call syntax; chat (whole and streamed), Responses and Messages return
    it as a call to ``f``, the span says ``ok``, and each rollout of calls and results is one sequence."""
    model, reply_ids, gw = scripted
    c = openai.OpenAI(base_url=f"{gw.base_url}/rollouts/s-chat/v1", api_key="unused", max_retries=0, timeout=120)
    tools = [{"type": "function", "function": {"name": "f", "description": "F", "parameters": F}}]
    msgs: list = [{"role": "user", "content": "Call f."}]
    one = c.chat.completions.create(model=model, messages=msgs, tools=tools, max_tokens=40)
    call = one.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == ("f", "{}")
    assert one.choices[0].finish_reason == "tool_calls"
    msgs += [one.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "done"}]
    chunks = list(c.chat.completions.create(model=model, messages=msgs, tools=tools, stream=True, max_tokens=40))
    streamed = [t for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [("f", "{}")]
    spans = check_one_merged_sequence(gw.base_url, "s-chat", [one.id, chunks[0].id])
    assert [s["choices"][0]["output_ids"] for s in spans] == [reply_ids] * 2
    assert [s["attributes"]["tracegym.tool_parse"] for s in spans] == ["ok", "ok"]

    r = openai.OpenAI(base_url=f"{gw.base_url}/rollouts/s-resp/v1", api_key="unused", max_retries=0, timeout=120)
    kw = {"model": model, "tools": [{"type": "function", "name": "f", "parameters": F}], "max_output_tokens": 40}
    first = r.responses.create(input="Call f.", **kw)
    fc = next(o for o in first.output if o.type == "function_call")
    assert (fc.name, fc.arguments) == ("f", "{}")
    second = r.responses.create(previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": fc.call_id, "output": "done"}], **kw)
    check_one_merged_sequence(gw.base_url, "s-resp", [first.id, second.id])

    a = anthropic.Anthropic(base_url=f"{gw.base_url}/rollouts/s-msg", api_key="unused", max_retries=0, timeout=120)
    akw = {"model": model, "max_tokens": 40, "tools": [{"name": "f", "input_schema": F}]}
    amsgs: list = [{"role": "user", "content": "Call f."}]
    m1 = a.messages.create(messages=amsgs, **akw)
    use = next(b for b in m1.content if b.type == "tool_use")
    assert use.name == "f" and use.input == {} and m1.stop_reason == "tool_use"
    amsgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "done"}]}]
    m2 = a.messages.create(messages=amsgs, **akw)
    check_one_merged_sequence(gw.base_url, "s-msg", [m1.id, m2.id])
