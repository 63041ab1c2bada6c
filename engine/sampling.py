"""SGLang ``sampling_params``: validation, and per-row sampling with logprobs.

Logprobs are those of the sampled token under the model's **unmodified** distribution: log_softmax of the
raw logits (temperature 1, before top-k/top-p/min-p and before masking stop tokens for
``min_new_tokens``). That is what the trainer recomputes, so the engine-vs-trainer logprob mismatch is a
meaningful metric. (SGLang by default reports the logprobs of the temperature-scaled logits, and the raw
ones with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``; this engine always reports the raw ones.)
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

import torch

ALL_TOP_K = 1 << 30
GREEDY_EPS = 1e-6

# Keys SGLang 0.5.23 accepts that this engine does not implement: accepted only at their default value.
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
}
_IGNORED = {"spaces_between_special_tokens"}


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_regex: tuple[str, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    sampling_seed: int | None = None
    stream_interval: int = 1
    compiled_regex: tuple[re.Pattern[str], ...] = field(default=(), compare=False, repr=False)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1


KNOWN_KEYS = (
    frozenset(SamplingParams.__dataclass_fields__) - {"compiled_regex"}
    | set(_UNSUPPORTED_DEFAULTS)
    | _IGNORED
)


def _as_tuple(value: Any, kind: type, key: str) -> tuple:
    if value is None:
        return ()
    items = [value] if isinstance(value, kind) else value
    if not isinstance(items, list) or not all(isinstance(x, kind) and not isinstance(x, bool) for x in items):
        raise ValueError(f"sampling_params.{key} must be a {kind.__name__} or a list of them, got {value!r}")
    return tuple(items)


def _number(raw: dict, key: str, kind: type, default: Any) -> Any:
    v = raw.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise ValueError(f"sampling_params.{key} must be {kind.__name__}, got {v!r}")
    return kind(v)


def _flag(raw: dict, key: str, default: bool) -> bool:
    v = raw.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"sampling_params.{key} must be a boolean, got {v!r}")
    return v


def parse_sampling_params(raw: dict | None) -> SamplingParams:
    """Validate SGLang's ``sampling_params``; unknown keys and bad values raise ``ValueError`` (HTTP 400)."""
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ValueError(f"sampling_params must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - KNOWN_KEYS)
    if unknown:
        raise ValueError(f"unknown sampling_params keys {unknown}; accepted: {sorted(KNOWN_KEYS)}")
    for key, default in _UNSUPPORTED_DEFAULTS.items():
        if key in raw and raw[key] not in (default, None):
            raise ValueError(f"sampling_params.{key} is not supported by the embedded engine")
    top_k = _number(raw, "top_k", int, -1)
    p = SamplingParams(
        max_new_tokens=_number(raw, "max_new_tokens", int, 128),
        min_new_tokens=_number(raw, "min_new_tokens", int, 0),
        temperature=_number(raw, "temperature", float, 1.0),
        top_p=_number(raw, "top_p", float, 1.0),
        top_k=-1 if top_k >= ALL_TOP_K else top_k,
        min_p=_number(raw, "min_p", float, 0.0),
        stop=_as_tuple(raw.get("stop"), str, "stop"),
        stop_token_ids=_as_tuple(raw.get("stop_token_ids"), int, "stop_token_ids"),
        stop_regex=_as_tuple(raw.get("stop_regex"), str, "stop_regex"),
        ignore_eos=_flag(raw, "ignore_eos", False),
        no_stop_trim=_flag(raw, "no_stop_trim", False),
        skip_special_tokens=_flag(raw, "skip_special_tokens", True),
        n=_number(raw, "n", int, 1),
        sampling_seed=_number(raw, "sampling_seed", int, None),
        stream_interval=_number(raw, "stream_interval", int, 1),
    )
    _check_ranges(p)
    try:
        compiled = tuple(re.compile(r) for r in p.stop_regex)
    except re.error as e:
        raise ValueError(f"sampling_params.stop_regex is not a valid regex: {e}") from e
    object.__setattr__(p, "compiled_regex", compiled)
    return p


def _check_ranges(p: SamplingParams) -> None:
    checks = [
        (p.max_new_tokens >= 0, "max_new_tokens must be >= 0"),
        (p.min_new_tokens >= 0, "min_new_tokens must be >= 0"),
        (p.temperature >= 0, "temperature must be >= 0"),
        (0 < p.top_p <= 1, "top_p must be in (0, 1]"),
        (p.top_k == -1 or p.top_k >= 1, "top_k must be -1 (all) or >= 1"),
        (0 <= p.min_p <= 1, "min_p must be in [0, 1]"),
        (p.n >= 1, "n must be >= 1"),
        (p.stream_interval >= 1, "stream_interval must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(f"sampling_params: {message}")


def make_generator(seed: int | None, device: str | torch.device) -> torch.Generator:
    """A generator seeded with ``seed`` (reproducible) or with fresh OS entropy."""
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else random.SystemRandom().getrandbits(63))
    return g


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Sampling distribution of one row ``logits[V]`` (float32) after temperature, top-k, min-p, top-p."""
    x = logits / p.temperature
    if 0 < p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1:
        sorted_p, idx = torch.sort(probs, descending=True)
        drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) > p.top_p
        probs = probs.scatter(0, idx, sorted_p.masked_fill(drop, 0.0))
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from ``probs[V]`` by inverting its CDF with a single uniform number (``torch.multinomial``
    draws V exponentials per sample). Zero-probability tokens are never drawn."""
    cdf = torch.cumsum(probs.double(), dim=0)
    u = torch.rand((), dtype=torch.float64, generator=generator, device=probs.device) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.numel() - 1)


def sample_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    banned: list[tuple[int, ...]],
) -> tuple[list[int], list[float], torch.Tensor]:
    """Sample one token per row of ``logits[B, V]``.

    Returns ``(token_ids, logprobs, logprob_matrix[B, V])``, the logprobs being those of the raw logits
    (see the module docstring). ``banned[i]`` are token ids row ``i`` may not sample (stop ids before
    ``min_new_tokens``); they are masked for sampling only."""
    logits = logits.float()
    logprob_matrix = torch.log_softmax(logits, dim=-1)
    tokens: list[int] = []
    for i, p in enumerate(params):
        row = logits[i]
        if banned[i]:
            row = row.clone()
            row[list(banned[i])] = float("-inf")
        tokens.append(
            int(torch.argmax(row)) if p.greedy else sample_from(filtered_probs(row, p), generators[i])
        )
    picked = logprob_matrix[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)]
    return tokens, picked.tolist(), logprob_matrix


def top_logprobs(logprob_row: torch.Tensor, k: int) -> list[tuple[float, int]]:
    values, ids = torch.topk(logprob_row, k)
    return list(zip(values.tolist(), ids.tolist(), strict=True))


PROMPT_CHUNK_ROWS = 256
"""Rows of prompt logits turned into logprobs at a time: a long prompt never holds a float32 [T, V] copy
beside the model's logits."""


def prompt_logprobs(
    logits: torch.Tensor, input_ids: list[int], start: int, top_k: int, chunk_rows: int = PROMPT_CHUNK_ROWS
) -> tuple[list[float | None], list[list[tuple[float, int]] | None] | None]:
    """SGLang's ``input_token_logprobs`` values (and ``input_top_logprobs`` with ``top_k`` > 0) of the prompt
    ``input_ids`` from position ``start`` on, from the prefill's ``logits[len(input_ids) - start, V]`` of
    positions ``start`` .. the last (raw logits, as the sampled tokens' logprobs: see the module docstring).

    Entry ``j`` is the logprob of ``input_ids[start + j]`` given the tokens before it, read from the logits
    of position ``start + j - 1``; entry 0 is None (SGLang leaves it out even when ``start`` > 0, as the
    logits before ``start`` are not computed). The last position's logits predict the first output token and
    are not used here."""
    if logits.shape[0] != len(input_ids) - start:
        raise ValueError(f"{logits.shape[0]} logit rows for prompt positions {start}..{len(input_ids) - 1}")
    rows = logits[:-1]
    targets = torch.tensor(input_ids[start + 1 :], dtype=torch.long, device=logits.device)
    picked: list[float] = []
    tops: list[list[tuple[float, int]]] = []
    for lo in range(0, rows.shape[0], chunk_rows):
        lp = torch.log_softmax(rows[lo : lo + chunk_rows].float(), dim=-1)
        picked += lp.gather(1, targets[lo : lo + chunk_rows, None])[:, 0].tolist()
        if top_k > 0:
            values, ids = torch.topk(lp, min(top_k, lp.shape[-1]), dim=-1)
            tops += [list(zip(v, i, strict=True)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)]
    return [None, *picked], ([None, *tops] if top_k > 0 else None)


def find_stop_string(text: str, p: SamplingParams) -> tuple[int, str] | None:
    """The earliest match of a stop string or stop regex in ``text``: ``(start index, matched text)``."""
    best: tuple[int, str] | None = None
    for s in p.stop:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    for rx in p.compiled_regex:
        m = rx.search(text)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), m.group(0))
    return best
