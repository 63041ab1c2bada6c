"""Real agent frameworks against ``tracegym serve --engine embedded --model tiny-random``: the OpenAI Agents
SDK (``Agent`` + ``function_tool`` run by ``Runner.run``, on the Responses API and on Chat Completions),
LangChain's ``ChatOpenAI(use_responses_api=True)`` and ``langchain-anthropic``'s ``ChatAnthropic``. The
rollout goes in the base URL (``{gateway}/rollouts/{rid}/v1``; Anthropic's without ``/v1``), so nothing
depends on header injection. tiny-random writes random text: the calls need only work, be recorded under
the right rollout through the right API, and (for multi-turn use) merge into one trained sequence."""

from __future__ import annotations

import asyncio
import re
from importlib.metadata import version

import pytest

from tests.gateway.app_support import check_one_merged_sequence, spans_of
from tests.procs import ManagedProcess

MODEL = "tiny-random"
AGENTS_FAIL_INCOMPLETE = tuple(int(x) for x in version("openai-agents").split(".")[:2]) >= (0, 24)
"""From 0.24 the Agents SDK fails a Responses turn that ended ``incomplete`` (tiny-random's reply is cut
at ``max_output_tokens``), as it would against OpenAI."""
# Each test imports its framework: imported here, every xdist worker collecting this module paid for the
# Agents SDK and langchain-anthropic (seconds of imports), though one worker runs these tests.


def add_tool(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def one_sequence(base_url: str, rollout: str, n: int) -> list[dict]:
    """The rollout's ``n`` spans, checked to merge into one sequence of the engine's sampled ids."""
    spans = spans_of(base_url, rollout, n)
    assert len(spans) == n, spans
    return check_one_merged_sequence(base_url, rollout, [s["call_id"] for s in spans])


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_openai_agents_runner(gateway: ManagedProcess, api: str) -> None:
    from agents import (
        Agent,
        ModelBehaviorError,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the Agents SDK would export its own traces to OpenAI
    model_cls = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    rollout = f"agents-{api}"

    async def run() -> object:
        client = AsyncOpenAI(base_url=f"{gateway.base_url}/rollouts/{rollout}/v1", api_key="unused",
                             max_retries=0, timeout=120)
        agent = Agent(name="calc", instructions="Use the add tool.", tools=[function_tool(add_tool)],
                      model=model_cls(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(max_tokens=8, temperature=1.0))
        try:
            return (await Runner.run(agent, "What is 2+3?", max_turns=3)).final_output
        finally:
            await client.close()

    try:
        final = asyncio.run(run())
        assert isinstance(final, str) and final  # random text, but an answer
    except ModelBehaviorError as e:  # the SDK read our terminal event as OpenAI's own
        assert AGENTS_FAIL_INCOMPLETE and api == "responses", e
        assert "response.incomplete" in str(e) and "max_output_tokens" in str(e), e
        final = ""
    (span,) = spans_of(gateway.base_url, rollout, 1)
    attrs = span["attributes"]
    assert span["rollout_id"] == rollout and span["status"] == "ok" and attrs["tracegym.api"] == api
    request = attrs["tracegym.request"]
    assert [t["function"]["name"] for t in request["tools"]] == ["add_tool"]
    assert request["messages"][0] == {"role": "system", "content": "Use the add tool."}
    assert re.fullmatch(r"ok|none|failed: .+", attrs["tracegym.tool_parse"])  # tools offered: parsed
    assert span["choices"][0]["output_ids"] and final in str(span["choices"][0]["message"]["content"])


def test_langchain_chat_openai_on_the_responses_api(gateway: ManagedProcess) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{gateway.base_url}/rollouts/lc-responses/v1", api_key="unused",
                     use_responses_api=True, max_tokens=8, max_retries=0, timeout=120).bind_tools([tool(add)])
    messages: list = [SystemMessage("Be brief."), HumanMessage("What is 2+3?")]
    for follow_up in ("And 3+4?", "Thanks."):
        reply = llm.invoke(messages)
        assert isinstance(reply, AIMessage) and reply.response_metadata["model_name"] == MODEL
        messages += [reply, HumanMessage(follow_up)]  # the reply goes back as LangChain holds it
    spans = one_sequence(gateway.base_url, "lc-responses", 2)
    assert {s["attributes"]["tracegym.api"] for s in spans} == {"responses"}
    assert spans[1]["attributes"]["tracegym.drift"] != "forked"


def test_langchain_chat_anthropic(gateway: ManagedProcess) -> None:
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_core.tools import tool

    llm = ChatAnthropic(model=MODEL, base_url=f"{gateway.base_url}/rollouts/lc-anthropic", api_key="unused",
                        max_tokens=8, max_retries=0, default_request_timeout=120).bind_tools([tool(add)])
    messages: list = [SystemMessage("Be brief."), HumanMessage("What is 2+3?")]
    for follow_up in ("And 3+4?", "Thanks."):
        reply = llm.invoke(messages)
        assert isinstance(reply, AIMessage) and reply.response_metadata["model"] == MODEL
        messages += [reply, HumanMessage(follow_up)]
    stream = "".join(str(c.content) for c in ChatAnthropic(
        model=MODEL, base_url=f"{gateway.base_url}/rollouts/lc-anthropic-stream", api_key="unused",
        max_tokens=8, max_retries=0).stream(messages[:2]))
    assert stream
    spans = one_sequence(gateway.base_url, "lc-anthropic", 2)
    assert {s["attributes"]["tracegym.api"] for s in spans} == {"messages"}
    assert spans[0]["attributes"]["tracegym.request"]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert spans_of(gateway.base_url, "lc-anthropic-stream", 1)[0]["attributes"]["tracegym.api"] == "messages"
