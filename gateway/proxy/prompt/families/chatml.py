"""ChatML (SmolLM2 and other ``<|im_start|>role ... <|im_end|>`` models without tool support in their
template): tools are injected hermes-style into the system prompt and calls written as
``<tool_call>{json}</tool_call>`` text (``prompt/tools.py``); the model's own template renders the rest."""

from __future__ import annotations

from collections.abc import Collection

from tracegym.gateway.proxy.prompt.families.base import Family


def _recognise(template: str, tokens: Collection[str]) -> bool:
    return "<|im_start|>" in tokens or "<|im_start|>" in template


FAMILY = Family(
    name="chatml",
    summary="ChatML turns; tools injected into the system prompt, hermes <tool_call> JSON calls",
    recognise=_recognise,
    tool_syntax='<tool_call>{"name": ..., "arguments": {...}}</tool_call> (one block per call)',
    stop_tokens=("<|im_end|>",),
)
