"""The tiny models' tokenizers loaded once per test process (``ChatTokenizer`` and transformers' own), for
tests that only read from them: a large vocabulary takes a second of CPU to load (gemma3-tiny's 262k
tokens), and the family tests read the same six tokenizers over and over. A test that checks a
tokenizer's caches (hits, misses) or changes it builds its own with ``ChatTokenizer.from_dir``.

The modules that read them run on one worker (``ONE_WORKER``) under ``pytest -n N --dist loadgroup``, which
loads each tokenizer once instead of once per worker that draws one of their tests."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest

from tracegym.gateway.proxy.prompt.templating import ChatTokenizer

ONE_WORKER = pytest.mark.xdist_group("shared_tokenizers")
"""``pytestmark`` of the modules that read the shared tokenizers."""


def _model_dir(model: str | Path) -> Path:
    """A model name ``prepare_model`` knows (prepared once per machine), or a model directory as is."""
    if isinstance(model, Path):
        return model
    from tracegym.modelfiles.prepare import prepare_model

    return prepare_model(model)


def chat_tokenizer(model: str | Path) -> ChatTokenizer:
    """``ChatTokenizer.from_dir`` of ``model``, shared by the tests of this process. Its render and encode
    caches are exact (a hit returns what a fresh render would), so sharing them changes no result."""
    return _chat_tokenizer(_model_dir(model))


def hf_tokenizer(model: str | Path) -> Any:
    """``AutoTokenizer.from_pretrained`` of ``model`` (transformers' reference), shared likewise."""
    return _hf_tokenizer(_model_dir(model))


@cache
def _chat_tokenizer(d: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(d)


@cache
def _hf_tokenizer(d: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(d)
