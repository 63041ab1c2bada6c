"""A LangChain agent (a prompt template | ChatOpenAI | output parser chain in a tool loop), trained by
tracegym (`recipe.yaml`).

    tracegym train examples/langchain/recipe.yaml

or, against a gateway you started (`tracegym serve --engine embedded --model smollm2-135m`):

    tracegym enqueue examples/langchain/eval.jsonl --group-size 4
    tracegym run examples/langchain/agent.py:agent --gateway http://127.0.0.1:8000 --concurrency 16

The task: the sum or difference of two 3-digit numbers. A reply ``CALC <a> <op> <b>`` gets
``RESULT <number>`` back as the next human message, and the chain runs again on the longer
conversation. The tool speaks text because SmolLM2-135M never writes a JSON function call
(docs/agents.md); with a model that does, ``llm.bind_tools([...])`` and ``reply.tool_calls`` take its
place. The reward is 1.0 when the last reply's last number is the answer. The two tracegym lines are
marked; the rest is the agent.
"""

from __future__ import annotations

import os
import re

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_openai import ChatOpenAI

import tracegym as tg

MODEL = os.environ.get("TRACEGYM_MODEL", "smollm2-135m")  # the name the gateway serves
MAX_TOKENS = int(os.environ.get("TRACEGYM_MAX_TOKENS", "32"))
MAX_TURNS = 3
CALL = re.compile(r"CALC\s+(-?\d+)\s*([-+*/x])\s*(-?\d+)")
PROMPT = ChatPromptTemplate.from_messages([
    ("system", "You have a calculator. To use it, reply with one line: CALC <a> <op> <b>. "
               "You get RESULT <number> back; then reply with the number."),
    # one worked exchange at the head of every conversation
    ("human", "What is 512 - 187?"), ("ai", "CALC 512 - 187"), ("human", "RESULT 325"), ("ai", "325"),
    MessagesPlaceholder("conversation"),
])


def calculator(a: int, op: str, b: int) -> str:
    """The tool: ``RESULT <number>`` for ``a op b``."""
    value = {"+": a + b, "-": a - b, "*": a * b, "x": a * b, "/": a / b if b else float("nan")}[op]
    return f"RESULT {int(value) if value == int(value) else value}" if value == value else "RESULT undefined"


def score(text: str, answer: int) -> float:
    """1.0 if the last number in the reply is the answer, else 0.0 (handles any text)."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    return 1.0 if numbers and float(numbers[-1]) == answer else 0.0


def agent(task: dict, base_url: str) -> None:
    # tracegym line 1: the rollout's base_url
    llm = ChatOpenAI(model=MODEL, base_url=base_url, api_key="unused", max_tokens=MAX_TOKENS, temperature=1.0,
                     max_retries=0)
    chain = PROMPT | llm | StrOutputParser()
    conversation: list[BaseMessage] = [HumanMessage(task["question"])]
    reply, called = "", False
    for _ in range(MAX_TURNS):  # bounded: a model that never stops calling the tool still ends
        reply = chain.invoke({"conversation": conversation})
        conversation.append(AIMessage(reply))
        call = CALL.search(reply)
        if call is None:
            break  # an answer
        called = True
        conversation.append(HumanMessage(calculator(int(call.group(1)), call.group(2), int(call.group(3)))))
    tg.emit("tool_call", float(called))  # what the agent did, averaged in each evaluation
    tg.reward(0.0 if CALL.search(reply) else score(reply, task["answer"]))  # tracegym line 2: the reward
