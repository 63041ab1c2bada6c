"""An Anthropic SDK agent (``anthropic.Anthropic``, the Messages API, multi-turn) with a calculator, trained by
tracegym (`recipe.yaml`).

    tracegym train examples/anthropic/recipe.yaml

or, against a gateway you started (`tracegym serve --engine embedded --model smollm2-135m`):

    tracegym enqueue examples/anthropic/eval.jsonl --group-size 4
    tracegym run examples/anthropic/agent.py:agent --gateway http://127.0.0.1:8000 --concurrency 16

The task: a 4-digit number divided by a 2-digit one, with a whole quotient. A reply ``CALC <a> <op> <b>``
gets ``RESULT <number>`` back as the next user turn, and the model answers from it. The tool speaks text
because SmolLM2-135M never writes a tool call (docs/agents.md); with a model that does, ``tools=[...]``
and ``tool_use`` / ``tool_result`` blocks take its place in the same loop. The reward is 1.0 when the
last reply's last number is the answer. The two tracegym lines are marked. The Anthropic client appends
``/v1/messages`` itself, so its base URL is the rollout's without ``/v1``.
"""

from __future__ import annotations

import os
import re

import anthropic

import tracegym as tg

MODEL = os.environ.get("TRACEGYM_MODEL", "smollm2-135m")  # the name the gateway serves
MAX_TOKENS = int(os.environ.get("TRACEGYM_MAX_TOKENS", "32"))
MAX_TURNS = 3
SYSTEM = ("You have a calculator. To use it, reply with one line: CALC <a> <op> <b>. "
          "You get RESULT <number> back; then reply with the number.")
EXAMPLE = [  # one worked exchange at the head of every conversation
    {"role": "user", "content": "What is 2961 / 47?"},
    {"role": "assistant", "content": "CALC 2961 / 47"},
    {"role": "user", "content": "RESULT 63"},
    {"role": "assistant", "content": "63"},
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


def agent(task: dict, base_url: str) -> None:
    # tracegym line 1: the rollout's base_url, without /v1
    client = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="unused", max_retries=0)
    messages = [*EXAMPLE, {"role": "user", "content": task["question"]}]
    text, called = "", False
    for _ in range(MAX_TURNS):  # bounded: a model that never stops calling the tool still ends
        reply = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, system=SYSTEM, messages=messages)
        text = "".join(b.text for b in reply.content if b.type == "text")
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        call = CALL.search(text)
        if call is None:
            break  # an answer
        called = True
        messages.append({"role": "user", "content": calculator(int(call.group(1)), call.group(2), int(call.group(3)))})
    client.close()
    tg.emit("tool_call", float(called))  # what the agent did, averaged in each evaluation
    tg.reward(0.0 if CALL.search(text) else score(text, task["answer"]))  # tracegym line 2: the reward
