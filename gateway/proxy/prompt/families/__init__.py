"""Model families: one module per family (chat rendering inputs, tool-call syntax, reasoning markers, stop
tokens, what the template rewrites in earlier turns), found by name or recognised from a tokenizer.

``FAMILIES`` is the registry, in recognition order (the first whose ``recognise`` accepts a tokenizer wins:
the markers are checked from the most specific to the most general). Adding a family is one module with a
``FAMILY`` and one line here (docs/model-families.md).
"""

from __future__ import annotations

from collections.abc import Collection

from tracegym.gateway.proxy.prompt.families import chatml, deepseek_v3, gemma3, gpt_oss, llama3, qwen3
from tracegym.gateway.proxy.prompt.families.base import BufferedToolParser, Family

FAMILIES: dict[str, Family] = {f.name: f for f in (
    gpt_oss.FAMILY, deepseek_v3.FAMILY, llama3.FAMILY, gemma3.FAMILY, qwen3.FAMILY, chatml.FAMILY)}

__all__ = ["DEFAULT", "FAMILIES", "BufferedToolParser", "Family", "UnknownChatFormat", "detect", "family"]


DEFAULT = chatml.FAMILY
"""The family of replies read without a tokenizer (hermes ``<tool_call>`` syntax, ``<think>`` reasoning)."""


class UnknownChatFormat(ValueError):
    """No family recognises a tokenizer, or a ``chat_format`` names none."""


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnknownChatFormat(f"unknown chat format {name!r}; the families are: {', '.join(FAMILIES)}") from None


def detect(template: str, tokens: Collection[str], *, where: str = "the tokenizer") -> Family:
    """The family of a tokenizer: its chat template sources (joined) and its added-token strings."""
    for f in FAMILIES.values():
        if f.recognise(template, tokens):
            return f
    raise UnknownChatFormat(
        f"{where}: no model family recognised; looked for the added tokens or template markers "
        "<|channel|> (gpt_oss), <｜tool▁calls▁begin｜> (deepseek_v3), <|start_header_id|> (llama3), "
        "<start_of_turn> (gemma3), <|im_start|> with <tool_call> and reasoning_content (qwen3), "
        f"<|im_start|> (chatml). Name the family to use one anyway: tracegym serve --chat-format NAME (or "
        f"$TRACEGYM_CHAT_FORMAT), NAME one of {', '.join(FAMILIES)}")

