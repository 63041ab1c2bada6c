"""A LangChain agent (ChatOpenAI + a tool, multi-turn), trained by tracegym.

    tracegym serve --engine embedded --model smollm2-135m &
    tracegym enqueue examples/langchain/tasks.jsonl --group-size 4
    tracegym run examples/langchain/agent.py:agent --gateway http://127.0.0.1:8000 --concurrency 4

`tracegym run` calls agent(task, base_url) for each queued rollout. The two tracegym lines are marked.
"""

import os
import re

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

import tracegym as tg

MODEL = os.environ.get("TRACEGYM_MODEL", "smollm2-135m")  # the name the gateway serves
MAX_TOKENS = int(os.environ.get("TRACEGYM_MAX_TOKENS", "256"))
MAX_TURNS = 3


@tool
def calculator(a: float, op: str, b: float) -> str:
    """Compute `a op b` for op in + - * /."""
    ops = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else float("nan")}
    return str(ops[op]) if op in ops else f"error: unknown op {op!r}"


calculator.handle_validation_error = True  # bad arguments from the model become a message, not a crash


def score(text: object, answer: float) -> float:
    """1.0 if the last number in the reply is the answer, else 0.0 (handles any text)."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", str(text or ""))
    return 1.0 if numbers and float(numbers[-1]) == answer else 0.0


def agent(task: dict, base_url: str) -> None:
    # tracegym line 1: the rollout's base_url
    llm = ChatOpenAI(model=MODEL, base_url=base_url, api_key="unused", max_tokens=MAX_TOKENS)
    llm = llm.bind_tools([calculator])
    messages = [
        SystemMessage("Use the calculator tool, then reply with just the number."),
        HumanMessage(task["question"]),
    ]
    for _ in range(MAX_TURNS):  # bounded: a model that never stops calling tools still ends
        reply = llm.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            break
        messages.extend(calculator.invoke(call) for call in reply.tool_calls)  # ToolMessages
    tg.reward(score(reply.content, task["answer"]))  # tracegym line 2: the reward
