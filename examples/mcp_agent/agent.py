"""An OpenAI-SDK tool loop whose tools come from a local MCP server over stdio (``server.py``).

    tracegym serve --engine embedded --model smollm2-135m &
    tracegym enqueue examples/mcp_agent/tasks.jsonl --group-size 4
    tracegym run examples/mcp_agent/agent.py:agent --gateway http://127.0.0.1:8000 --concurrency 4

Each rollout starts the MCP server (``mcp.Client`` over ``StdioServerParameters``), lists its tools as
OpenAI function tools, and runs a bounded loop: the model's tool calls go to the MCP server and their
results go back as ``tool`` messages. The two tracegym lines are marked; the MCP side needs none.
"""

import json
import os
import re
import sys
from pathlib import Path

from mcp import Client, StdioServerParameters
from openai import AsyncOpenAI

import tracegym as tg

MODEL = os.environ.get("TRACEGYM_MODEL", "smollm2-135m")  # the name the gateway serves
MAX_TOKENS = int(os.environ.get("TRACEGYM_MAX_TOKENS", "256"))
MAX_TURNS = 3
SERVER = StdioServerParameters(command=sys.executable, args=[str(Path(__file__).with_name("server.py"))])


def openai_tools(listing: object) -> list[dict]:
    """MCP tool descriptions as OpenAI function tools."""
    return [
        {"type": "function",
         "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema}}
        for t in listing.tools  # type: ignore[attr-defined]
    ]


async def run_tool(mcp: Client, name: str, arguments: str) -> str:
    """One tool call on the MCP server; a bad call becomes an error message for the model."""
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError as e:
        return f"error: arguments are not JSON: {e}"
    if not isinstance(args, dict):
        return "error: arguments must be a JSON object"
    result = await mcp.call_tool(name, args)  # an unknown tool or bad arguments come back as is_error
    text = "".join(getattr(c, "text", "") for c in result.content)
    return f"error: {text}" if result.is_error else text


def score(text: str | None, answer: str) -> float:
    """1.0 if the reply ends with the answer (its last word or number), else 0.0."""
    words = re.findall(r"[\w.-]+", text or "")
    return 1.0 if words and words[-1].strip(".").lower() == str(answer).lower() else 0.0


async def agent(task: dict, base_url: str) -> None:
    llm = AsyncOpenAI(base_url=base_url, api_key="unused")  # tracegym line 1: the rollout's base_url
    messages = [
        {"role": "system", "content": "Use the tools, then reply with just the answer."},
        {"role": "user", "content": task["question"]},
    ]
    reply = None
    async with Client(SERVER) as mcp:
        tools = openai_tools(await mcp.list_tools())
        for _ in range(MAX_TURNS):  # bounded: a model that never stops calling tools still ends
            response = await llm.chat.completions.create(
                model=MODEL, messages=messages, tools=tools, max_tokens=MAX_TOKENS
            )
            reply = response.choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                break
            for call in reply.tool_calls:
                result = await run_tool(mcp, call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    await llm.close()
    await tg.areward(score(reply.content if reply else None, task["answer"]))  # tracegym line 2: the reward
