"""An OpenAI-SDK tool loop whose tools come from a local MCP server over stdio (``server.py``), trained by
tracegym (`recipe.yaml`).

    tracegym train examples/mcp_agent/recipe.yaml

or, against a gateway you started (`tracegym serve --engine embedded --model smollm2-135m`):

    tracegym enqueue examples/mcp_agent/eval.jsonl --group-size 4
    tracegym run examples/mcp_agent/agent.py:agent --gateway http://127.0.0.1:8000 --concurrency 16

Each rollout starts the MCP server (``mcp.Client`` over ``StdioServerParameters``), lists its tools in the
system prompt and runs a bounded loop. SmolLM2-135M never writes a function call (docs/agents.md), so the
tools are called in text, ``CALL <tool> <arguments>`` (one worked exchange per tool shows how), and the MCP
server's answer comes back as ``RESULT <value>`` in a user turn. With ``MCP_AGENT_FUNCTION_TOOLS=1`` (a
model that writes function calls) the tools are also offered as OpenAI function tools: a function call
goes to the MCP server and its result back as a ``tool`` message. The tasks ask for a sum of two 3-digit numbers
or a capital city (from the server's table; the held-out countries are not among the training ones). The
reward is 1.0 when the last reply ends with the answer. The two tracegym lines are marked; the MCP side
needs none.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters
from openai import AsyncOpenAI

import tracegym as tg

MODEL = os.environ.get("TRACEGYM_MODEL", "smollm2-135m")  # the name the gateway serves
MAX_TOKENS = int(os.environ.get("TRACEGYM_MAX_TOKENS", "32"))
MAX_TURNS = 3
SERVER = StdioServerParameters(command=sys.executable, args=[str(Path(__file__).with_name("server.py"))])
SYSTEM = ("You have tools:\n{tools}\nTo use one, reply with one line: CALL <tool> <arguments>. "
          "You get RESULT <value> back; then reply with just the answer.")
EXAMPLE = [  # one worked exchange per tool, at the head of every conversation
    {"role": "user", "content": "What is 512 + 187?"},
    {"role": "assistant", "content": "CALL add 512 187"},
    {"role": "user", "content": "RESULT 699"},
    {"role": "assistant", "content": "699"},
    {"role": "user", "content": "What is the capital of Canada?"},
    {"role": "assistant", "content": "CALL capital Canada"},
    {"role": "user", "content": "RESULT Ottawa"},
    {"role": "assistant", "content": "Ottawa"},
]
TEXT_CALL = re.compile(r"CALL\s+(\w+)\s+([^\n]+)")
FUNCTION_TOOLS = os.environ.get("MCP_AGENT_FUNCTION_TOOLS") == "1"


def openai_tools(listing: Any) -> list[dict]:
    """MCP tool descriptions as OpenAI function tools."""
    return [{"type": "function",
             "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema}}
            for t in listing.tools]


def tool_lines(listing: Any) -> str:
    """One line per MCP tool for the system prompt: ``add <a> <b>: Add two integers.``"""
    return "\n".join(f"{t.name} {' '.join(f'<{p}>' for p in t.input_schema.get('properties', {}))}: {t.description or ''}"
                     for t in listing.tools)


def text_arguments(schema: dict, text: str) -> dict:
    """``CALL <tool> <arguments>``'s arguments by the tool's schema: one per property in order (the last one
    takes the rest of the line), integers converted."""
    names = list(schema.get("properties", {}))
    parts = text.strip().split(maxsplit=max(len(names) - 1, 0))
    args: dict[str, Any] = {}
    for name, part in zip(names, parts, strict=False):
        kind = schema["properties"][name].get("type")
        args[name] = int(part) if kind == "integer" and re.fullmatch(r"-?\d+", part) else part.strip(" .")
    return args


async def run_tool(mcp: Client, name: str, args: Any) -> str:
    """One tool call on the MCP server; a bad call becomes an error message for the model."""
    if not isinstance(args, dict):
        return "error: arguments must be a JSON object"
    result = await mcp.call_tool(name, args)  # an unknown tool or bad arguments come back as is_error
    text = "".join(getattr(c, "text", "") for c in result.content)
    return f"error: {text}" if result.is_error else text


def score(text: str | None, answer: str) -> float:
    """1.0 if the reply ends with the answer (its last words or number), else 0.0."""
    want = re.findall(r"[\w'-]+", str(answer).lower())
    words = re.findall(r"[\w'-]+", (text or "").lower())
    return 1.0 if want and words[-len(want):] == want else 0.0


async def agent(task: dict, base_url: str) -> None:
    llm = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)  # tracegym line 1: the rollout's base_url
    text, called, answered = "", False, False
    async with Client(SERVER) as mcp:
        listing = await mcp.list_tools()
        schemas = {t.name: t.input_schema for t in listing.tools}
        messages: list[dict] = [{"role": "system", "content": SYSTEM.format(tools=tool_lines(listing))}, *EXAMPLE,
                                {"role": "user", "content": task["question"]}]
        for _ in range(MAX_TURNS):  # bounded: a model that never stops calling tools still ends
            tools = {"tools": openai_tools(listing)} if FUNCTION_TOOLS else {}
            response = await llm.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                         temperature=1.0, **tools)
            reply = response.choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            text = reply.content or ""
            if reply.tool_calls:  # a model that writes function calls
                called = True
                for call in reply.tool_calls:
                    try:
                        args = json.loads(call.function.arguments or "{}")
                    except json.JSONDecodeError as e:
                        args = f"error: arguments are not JSON: {e}"
                    result = await run_tool(mcp, call.function.name, args) if not isinstance(args, str) else args
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
                continue
            match = TEXT_CALL.search(text)
            if match is None:
                answered = True
                break
            called = True
            name = match.group(1)
            result = (await run_tool(mcp, name, text_arguments(schemas[name], match.group(2)))
                      if name in schemas else f"error: no tool {name!r}")
            messages.append({"role": "user", "content": f"RESULT {result}"})
    await llm.close()
    await tg.aemit("tool_call", float(called))  # what the agent did, averaged in each evaluation
    await tg.areward(score(text, task["answer"]) if answered else 0.0)  # tracegym line 2: the reward
