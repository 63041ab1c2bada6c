"""A plain OpenAI SDK agent with a calculator tool, trained by tracegym (`recipe.yaml`).

    tracegym train examples/openai/recipe.yaml

or, against a gateway you started (`tracegym serve --engine embedded --model smollm2-135m`):

    tracegym enqueue examples/openai/eval.jsonl --group-size 4
    tracegym run examples/openai/agent.py:agent --gateway http://127.0.0.1:8000 --concurrency 16

The task: a product of two 2-digit numbers, which SmolLM2-135M cannot compute in its head. A reply
``CALC <a> <op> <b>`` gets ``RESULT <number>`` back as the next message, and the model answers from it.
The tool speaks text because SmolLM2-135M never writes a JSON function call (docs/agents.md); a model
that does would get ``tools=[...]`` and ``reply.tool_calls`` in the same loop. The reward is 1.0 when
the last reply's last number is the product. The two tracegym lines are marked; the rest is the agent.
"""

from __future__ import annotations

import functools
import os
import re

import httpx
from openai import OpenAI

import tracegym as tg

MODEL = os.environ.get("TRACEGYM_MODEL", "smollm2-135m")  # the name the gateway serves
MAX_TOKENS = int(os.environ.get("TRACEGYM_MAX_TOKENS", "32"))
MAX_TURNS = 3
SYSTEM = ("You have a calculator. To use it, reply with one line: CALC <a> <op> <b>. "
          "You get RESULT <number> back; then reply with the number.")
EXAMPLE = [  # one worked exchange at the head of every conversation
    {"role": "user", "content": "What is 23 * 41?"},
    {"role": "assistant", "content": "CALC 23 * 41"},
    {"role": "user", "content": "RESULT 943"},
    {"role": "assistant", "content": "943"},
]
CALL = re.compile(r"CALC\s+(-?\d+)\s*([-+*/x])\s*(-?\d+)")


def calculator(a: int, op: str, b: int) -> str:
    """The tool: ``RESULT <number>`` for ``a op b``."""
    value = {"+": a + b, "-": a - b, "*": a * b, "x": a * b, "/": a / b if b else float("nan")}[op]
    return f"RESULT {int(value) if value == int(value) else value}" if value == value else "RESULT undefined"


def score(text: str, answer: int) -> float:
    """1.0 if the last number in the reply is the answer, else 0.0 (handles any text)."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    return 1.0 if numbers and float(numbers[-1]) == answer else 0.0


@functools.cache
def http_client() -> httpx.Client:
    """One connection pool for every rollout of this process."""
    return httpx.Client(timeout=300)


def agent(task: dict, base_url: str) -> None:
    # tracegym line 1: the rollout's base_url
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http_client())
    messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": task["question"]}]
    reply, called = "", False
    for _ in range(MAX_TURNS):  # bounded: a model that never stops calling the tool still ends
        response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=1.0)
        reply = response.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})
        call = CALL.search(reply)
        if call is None:
            break  # an answer
        called = True
        messages.append({"role": "user", "content": calculator(int(call.group(1)), call.group(2), int(call.group(3)))})
    tg.emit("tool_call", float(called))  # what the agent did, averaged in each evaluation
    tg.reward(0.0 if CALL.search(reply) else score(reply, task["answer"]))  # tracegym line 2: the reward
