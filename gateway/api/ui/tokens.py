"""Token ids as text for the inspector's token view, one token at a time, cached per id.

Decoding one token of a byte-level BPE vocabulary alone can give a partial UTF-8 character (shown as
U+FFFD); the view shows the id next to it, and the calls' messages show the text as the agent saw it."""

from __future__ import annotations

import threading
from typing import Any

MAX_CACHED = 300_000
"""Larger than any vocabulary in use; ids past it (a corrupt span) are decoded without caching."""


class TokenTexts:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._texts: dict[int, str] = {}

    def texts(self, tokenizer: Any, ids: list[int]) -> list[str] | None:
        """The text of each id (None without a tokenizer: a gateway on an upstream that has none)."""
        if tokenizer is None:
            return None
        with self._lock:
            get = self._texts.get
            out = [get(i) for i in ids]
        missing = {i for i, text in zip(ids, out, strict=True) if text is None}
        if missing:
            decoded = {i: _one(tokenizer, i) for i in missing}
            with self._lock:
                if len(self._texts) + len(decoded) <= MAX_CACHED:
                    self._texts.update(decoded)
            out = [decoded[i] if text is None else text for i, text in zip(ids, out, strict=True)]
        return out  # type: ignore[return-value]

def _one(tokenizer: Any, token_id: int) -> str:
    try:
        return tokenizer.decode([token_id], skip_special_tokens=False)  # show <|im_start|> and the like
    except (OverflowError, TypeError, ValueError):
        return f"<{token_id}?>"  # not in the vocabulary: shown, never fatal to the page
