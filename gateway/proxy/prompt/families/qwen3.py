"""Qwen3: ChatML turns, ``<think>…</think>`` reasoning, and tool calls as hermes ``<tool_call>`` JSON, all
rendered by Qwen3's own template (``tools`` and ``reasoning_content`` are template inputs). The template
drops the ``<think>`` block of assistant turns before the last user message."""

from __future__ import annotations

from collections.abc import Collection

from tracegym.gateway.proxy.prompt.families.base import Family


def _recognise(template: str, tokens: Collection[str]) -> bool:
    return "<|im_start|>" in template and "<tool_call>" in template and "reasoning_content" in template


FAMILY = Family(
    name="qwen3",
    summary="ChatML turns with <think> reasoning; hermes <tool_call> JSON calls rendered by the template",
    recognise=_recognise,
    tool_syntax='<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call> (one block per call)',
    reasoning="<think>\\n...\\n</think>\\n\\n before the text",
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
    history_rewrites="the <think> block of assistant turns before the last user message is dropped",
)
