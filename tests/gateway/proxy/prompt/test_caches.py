"""The prompt-path caches are exact: ``ChatTokenizer.encode`` (pieces between special tokens cached)
equals the tokenizer encoding the whole text, and a cached render equals a fresh one, on many
conversations with unicode, whitespace and special tokens at the boundaries; tokenizers for which
piecewise encoding would differ turn it off; the LRU stays within its bounds."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tracegym.gateway.proxy.prompt.caches import BoundedLRU, SegmentEncoder, render_key, segmentable
from tracegym.gateway.proxy.prompt.templating import ChatTokenizer

BITS = ["", " ", "  ", "\n", "\n\n", "\t", " \n ", "a", "hello", " world", "2+3=5", "é", "ü ", "漢字", "🙂",
        "\u200b", "'s", "don't", "   x", "x   ", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end",
        "|>", "<", "assistant\n", "system", "{\"a\": 1}", "```py\nprint(1)\n```", "\r\n", "\u00a0"]


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(BITS) for _ in range(rng.randint(0, 12)))


def _conversation(rng: random.Random) -> list[dict]:
    msgs = [{"role": "system", "content": _text(rng)}] if rng.random() < 0.7 else []
    for i in range(rng.randint(1, 5)):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": _text(rng)})
    if msgs[-1]["role"] == "assistant":
        msgs.append({"role": "user", "content": _text(rng)})
    return msgs


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(tiny_model_dir)


def test_cached_encode_equals_whole_encode(tok: ChatTokenizer) -> None:
    assert tok._encoder.pieces  # ChatML over byte-level BPE: piecewise is provably the same
    rng = random.Random(7)
    convs = [_conversation(rng) for _ in range(300)]
    for _ in range(2):  # the second pass is served from the cache
        for msgs in convs:
            text = tok.render(msgs)
            assert tok.encode(text) == tok.tokenizer.encode(text, add_special_tokens=False).ids, repr(text)
        for _ in range(200):  # raw texts (completions), special tokens anywhere
            text = _text(rng) + _text(rng)
            assert tok.encode(text) == tok.tokenizer.encode(text, add_special_tokens=False).ids, repr(text)
    assert tok._encoder.cache.hits > 500


def test_cached_render_equals_fresh_render(tok: ChatTokenizer) -> None:
    rng = random.Random(11)
    fresh = ChatTokenizer(tok.tokenizer, tok.templates, tok.special_tokens)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    for _ in range(150):
        msgs = _conversation(rng)
        kw = {"tools": tools} if rng.random() < 0.3 else {}
        first = tok.render(msgs, **kw)
        assert tok.render(msgs, **kw) == first == fresh._render(msgs, kw.get("tools"), True, None, {})
        assert tok.render(msgs, add_generation_prompt=False, **kw) == fresh._render(
            msgs, kw.get("tools"), False, None, {})
    assert tok._renders.hits >= 150
    # a render the cache has seen never leaks into a different request
    a = [{"role": "user", "content": "x"}]
    assert tok.render(a) != tok.render([{"role": "user", "content": "x "}])


def test_render_cache_off_for_clock_templates(tok: ChatTokenizer) -> None:
    timed = ChatTokenizer(tok.tokenizer, {"default": "{{ strftime_now('%H:%M') }}{{ messages[0].content }}"},
                          tok.special_tokens)
    assert timed._renders is None and tok._renders is not None
    assert timed.render([{"role": "user", "content": "hi"}]).endswith("hi")
    dated = ChatTokenizer(tok.tokenizer, {"default": "{{ strftime_now('%Y') }}{{ messages[0].content }}"},
                          tok.special_tokens)
    assert dated._renders is not None and dated._date_formats == ("%Y",)  # keyed on the date too
    assert render_key([{"a": object()}], None, True, None, {}) is None  # not JSON: rendered uncached


def _metaspace_first() -> tuple[Tokenizer, dict[str, int]]:
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    t.decoder = decoders.Metaspace(prepend_scheme="first")
    corpus = ["hello world", "the cat sat", "<s> user hello </s>", "world hello the"] * 50
    t.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    return t, {"<s>": t.token_to_id("<s>"), "</s>": t.token_to_id("</s>")}


def test_metaspace_first_is_not_split() -> None:
    t, splits = _metaspace_first()
    assert not segmentable(t, splits)
    text = "hello<s>hello world</s> the cat"
    whole = t.encode(text, add_special_tokens=False).ids
    assert SegmentEncoder(t, splits, pieces=True).encode(text) != whole  # why the guard exists
    enc = SegmentEncoder(t, splits)
    assert not enc.pieces and enc.encode(text) == whole and enc.encode(text) == whole
    assert enc.cache.hits == 1


def test_metaspace_first_inside_a_sequence_and_truncation_or_padding_are_not_split(tok: ChatTokenizer) -> None:
    t, splits = _metaspace_first()
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.Metaspace(prepend_scheme="first")])
    assert not segmentable(t, splits)
    split = {"<|im_end|>": tok.split_tokens["<|im_end|>"]}
    truncated = Tokenizer.from_str(tok.tokenizer.to_str())
    truncated.enable_truncation(64)
    padded = Tokenizer.from_str(tok.tokenizer.to_str())
    padded.enable_padding()
    assert not segmentable(truncated, split) and not segmentable(padded, split)


def test_overlapping_added_tokens_are_not_split(tok: ChatTokenizer) -> None:
    t = Tokenizer.from_str(tok.tokenizer.to_str())
    t.add_tokens(["end|><x"])  # can overlap the end of <|im_end|>
    assert not segmentable(t, {"<|im_end|>": tok.split_tokens["<|im_end|>"]})
    assert segmentable(tok.tokenizer, {"<|im_end|>": tok.split_tokens["<|im_end|>"]})


def test_bounded_lru_bounds() -> None:
    lru = BoundedLRU(max_entries=3, max_chars=1600)
    for i in range(5):
        lru.put(f"k{i}", i, 1)
    assert len(lru) == 3 and lru.get("k0") is None and lru.get("k4") == 4
    lru.get("k2")  # now most recently used
    lru.put("k5", 5, 1)
    assert lru.get("k3") is None and lru.get("k2") == 2
    lru.put("big", 0, 200)  # over max_chars // 16: not kept
    assert lru.get("big") is None
    for i in range(40):
        lru.put(f"x{i}", i, 90)
    assert lru.chars <= 1600 and bool(BoundedLRU(max_entries=1, max_chars=1))
