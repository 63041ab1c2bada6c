"""Token-exact caching of ``Tokenizer.encode`` for rendered chat prompts.

A fast tokenizer first splits its input on added tokens, then normalizes, pre-tokenizes and runs the
model on each piece between them on its own. So for a special token that always splits (not
``normalized``, no ``lstrip``/``rstrip``/``single_word``), encoding a rendered prompt equals encoding
the text pieces between those tokens one by one and joining them with the tokens' ids. Rendered chat
prompts are mostly such pieces that repeat (the system prompt and tool schemas of every call of a task,
the same prompt 4-16× per GRPO group), so ``SegmentEncoder`` caches the ids of each piece in a bounded
LRU keyed by its text.

Piecewise encoding is only used when it is provably the same as encoding whole (``segmentable``):
Metaspace ``prepend_scheme="first"`` (which treats the first piece differently), truncation or padding
configured in tokenizer.json, or added tokens that can overlap a split token turn it off, and a probe
on boundary cases (whitespace and unicode next to each split token) must agree at start-up. Otherwise
only whole texts are cached, which is exact by construction."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable

from tokenizers import Tokenizer

_PROBE_TEXTS = ("", " ", "\n", "  \n\t", "a", " hi ", "x\n\n", "é ü 漢字 🙂", "\u200b", "'s", "12 34")


def _overlap(a: str, b: str) -> bool:
    """Whether an occurrence of ``a`` and one of ``b`` can overlap in some text (a != b)."""
    if a in b or b in a:
        return True
    return any(a.endswith(b[:k]) or b.endswith(a[:k]) for k in range(1, min(len(a), len(b))))


def _structurally_segmentable(tokenizer: Tokenizer, split_tokens: Iterable[str]) -> bool:
    spec = json.loads(tokenizer.to_str())
    if spec.get("truncation") or spec.get("padding"):
        return False
    if '"prepend_scheme": "first"' in json.dumps(spec.get("pre_tokenizer")):
        return False
    splits = set(split_tokens)
    if not splits:
        return False
    added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
    return not any(_overlap(s, a) for s in splits for a in added if a != s)


def segmentable(tokenizer: Tokenizer, split_tokens: dict[str, int]) -> bool:
    """True when encoding piecewise at ``split_tokens`` provably equals encoding whole (module docstring)."""
    if not _structurally_segmentable(tokenizer, split_tokens):
        return False
    probe = SegmentEncoder(tokenizer, split_tokens, pieces=True, max_entries=64)
    for tok in split_tokens:
        for a in _PROBE_TEXTS:
            for b in _PROBE_TEXTS:
                text = f"{a}{tok}{b}{tok}{a}"
                if probe.encode(text) != tokenizer.encode(text, add_special_tokens=False).ids:
                    return False
    return True


class SegmentEncoder:
    """``encode(text) == tokenizer.encode(text, add_special_tokens=False).ids``, cached.

    With ``pieces`` (see ``segmentable``) the text pieces between split tokens are cached; else whole
    texts are. Bounded: at most ``max_entries`` entries and ``max_chars`` characters of keys (least
    recently used first out); a text longer than ``max_chars // 16`` is encoded but not cached.
    Thread-safe (the cache is updated under a lock; tokenizing runs outside it)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        split_tokens: dict[str, int],
        *,
        pieces: bool | None = None,
        max_entries: int = 16_384,
        max_chars: int = 16 * 1024 * 1024,
    ) -> None:
        if max_entries < 1 or max_chars < 1:
            raise ValueError("max_entries and max_chars must be >= 1")
        self._tok = tokenizer
        self._ids = dict(split_tokens)
        self.pieces = segmentable(tokenizer, split_tokens) if pieces is None else pieces
        alternatives = "|".join(re.escape(t) for t in sorted(self._ids, key=len, reverse=True))
        self._split = re.compile(f"({alternatives})").split if self.pieces and self._ids else None
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self._chars = 0
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._max_key = max(1, max_chars // 16)
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._cache)

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return list(self._cached(text))
        ids: list[int] = []
        for i, part in enumerate(self._split(text)):
            if i & 1:
                ids.append(self._ids[part])
            elif part:
                ids.extend(self._cached(part))
        return ids

    def _cached(self, text: str) -> tuple[int, ...]:
        cache = self._cache
        with self._lock:
            hit = cache.get(text)
            if hit is not None:
                cache.move_to_end(text)
                self.hits += 1
                return hit
            self.misses += 1
        ids = tuple(self._tok.encode(text, add_special_tokens=False).ids)
        if len(text) <= self._max_key:
            with self._lock:
                if text not in cache:
                    cache[text] = ids
                    self._chars += len(text)
                while len(cache) > self.max_entries or self._chars > self.max_chars:
                    old, _ = cache.popitem(last=False)
                    self._chars -= len(old)
        return ids
