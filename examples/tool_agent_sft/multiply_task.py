"""The task both agents of this example share: "What is A * B?" for two 2-digit numbers, the calculator tool
that answers a call, and the reward. The agents import it from beside them (the runner puts an agent's
folder on ``sys.path``); its name is the example's own, so no other example's module shadows it."""

from __future__ import annotations

import re

EXPRESSION = re.compile(r"^\s*(-?\d+)\s*([-+*/x])\s*(-?\d+)\s*$")


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def calculator(expression: str) -> str:
    """The tool: the value of ``a op b`` as text, or an error the model sees."""
    m = EXPRESSION.match(expression)
    if m is None:
        return "error: expected <integer> <op> <integer>"
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    if op == "/":
        return str(a / b) if b else "error: division by zero"
    return str({"+": a + b, "-": a - b, "*": a * b, "x": a * b}[op])


def score(text: str, answer: int) -> float:
    """1.0 when the last number in the reply is the answer."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    return 1.0 if numbers and float(numbers[-1]) == answer else 0.0
