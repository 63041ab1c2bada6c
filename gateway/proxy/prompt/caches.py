"""Exact caches for the prompt path: rendered chat prompts (``render_key``) and ``Tokenizer.encode``
of their pieces (``SegmentEncoder``).

A fast tokenizer first splits its input on added tokens, then normalizes, pre-tokenizes and runs the
model on each piece between them on its own. So for an added token that always splits (no
``lstrip``/``rstrip``/``single_word``; not ``normalized``, or a tokenizer without a normalizer; special or
not: ``templating.ChatTokenizer.split_tokens``), encoding a rendered prompt equals encoding the text pieces
between those tokens one by one and joining them with the tokens' ids. Rendered chat
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
from typing import Any

import orjson
from tokenizers import Tokenizer

_PROBE_TEXTS = ("", " ", "\n", "  \n\t", "a", " hi ", "x\n\n", "é ü 漢字 🙂", "\u200b", "'s", "12 34")


def overlap(a: str, b: str) -> bool:
    """Whether an occurrence of ``a`` and one of ``b`` can overlap in some text (a != b)."""
    if a in b or b in a:
        return True
    return any(a.endswith(b[:k]) or b.endswith(a[:k]) for k in range(1, min(len(a), len(b))))


def _structurally_segmentable(tokenizer: Tokenizer, split_tokens: Iterable[str]) -> bool:
    """The structural conditions of ``segmentable``, read from the tokenizer's settings and its pre-tokenizer's
    own state (not the whole serialized tokenizer: a large vocabulary makes that seconds of JSON)."""
    if tokenizer.truncation or tokenizer.padding:
        return False
    pre = tokenizer.pre_tokenizer
    if pre is not None and '"prepend_scheme": "first"' in json.dumps(json.loads(pre.__getstate__())):
        return False
    splits = set(split_tokens)
    if not splits:
        return False
    added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
    return not any(overlap(s, a) for s in splits for a in added if a != s)


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


def render_key(messages: Any, tools: Any, add_generation_prompt: bool, tool_choice: Any,
               kwargs: dict[str, Any]) -> bytes | None:
    """A chat render's inputs as JSON (key order kept: templates may iterate dicts), or None when they are
    not plain JSON values (then the render is not cached). The inputs come from parsed JSON, so two keys
    are equal exactly when the inputs are (NaN, which would serialize as null, cannot occur in them)."""
    try:
        return orjson.dumps([messages, tools, add_generation_prompt, tool_choice, kwargs])
    except TypeError:
        return None


class BoundedLRU:
    """A thread-safe LRU of str/bytes keys, bounded by entries and by the total length of keys and values
    (a pair longer than ``max_chars // 16`` is not kept)."""

    def __init__(self, *, max_entries: int, max_chars: int) -> None:
        if max_entries < 1 or max_chars < 1:
            raise ValueError("max_entries and max_chars must be >= 1")
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._max_item = max(1, max_chars // 16)
        self._data: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.chars = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._data)

    def __bool__(self) -> bool:  # an empty cache is still a cache
        return True

    def get(self, key: Any) -> Any:
        with self._lock:
            hit = self._data.get(key)
            if hit is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return hit[0]

    def put(self, key: Any, value: Any, size: int) -> None:
        """Keep ``value`` under ``key``; ``size`` counts toward ``max_chars`` (with the key's length)."""
        size += len(key)
        if size > self._max_item:
            return
        with self._lock:
            if key in self._data:
                return
            self._data[key] = (value, size)
            self.chars += size
            while len(self._data) > self.max_entries or self.chars > self.max_chars:
                _, (_, old) = self._data.popitem(last=False)
                self.chars -= old


class SegmentEncoder:
    """``encode(text) == tokenizer.encode(text, add_special_tokens=False).ids``, cached.

    With ``pieces`` (see ``segmentable``) the text pieces between split tokens are cached; else whole
    texts are, in a ``BoundedLRU`` (a text longer than ``max_chars // 16`` is encoded but not kept).
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
        self._tok = tokenizer
        self._ids = dict(split_tokens)
        self.pieces = segmentable(tokenizer, split_tokens) if pieces is None else pieces
        alternatives = "|".join(re.escape(t) for t in sorted(self._ids, key=len, reverse=True))
        self._split = re.compile(f"({alternatives})").split if self.pieces and self._ids else None
        self.cache = BoundedLRU(max_entries=max_entries, max_chars=max_chars)

    def __len__(self) -> int:
        return len(self.cache)

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
        ids = self.cache.get(text)
        if ids is None:
            ids = tuple(self._tok.encode(text, add_special_tokens=False).ids)
            self.cache.put(text, ids, len(ids))
        return ids
