"""Parsing SGLang's ``/generate`` body into the engine's requests (``ValueError`` → HTTP 400).

Batches: ``text`` or ``input_ids`` may be a list (of strings / of id lists); ``rid`` and
``sampling_params`` may then be lists too. With ``n > 1`` each prompt becomes ``n`` requests, ordered
prompt-major (prompt 0's samples first), with rids ``{rid}_{i}``; with a ``sampling_seed`` sample ``i``
uses seed ``sampling_seed + i`` so the ``n`` samples differ but stay reproducible.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from tracegym.engine.sampling import SamplingParams, parse_sampling_params

# Top-level fields SGLang knows that change the output and that this engine does not implement.
_UNSUPPORTED = {
    "input_embeds": None,
    "image_data": None,
    "token_ids_logprob": None,
    "session_params": None,
    "return_hidden_states": False,
    "return_routed_experts": False,
}


@dataclass(frozen=True)
class RequestSpec:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int | None
    lora: str | None = None
    """SGLang's ``lora_path``: the name of a loaded LoRA adapter (``/load_lora_adapter``); None = base."""
    logprob_start_len: int = -1
    """SGLang's ``logprob_start_len`` with ``return_logprob``: ``input_token_logprobs`` from this prompt
    position on (-1: none)."""


@dataclass(frozen=True)
class GenerateOptions:
    return_logprob: bool
    top_logprobs_num: int
    return_text_in_logprobs: bool
    return_prompt_token_ids: bool
    stream: bool
    is_batch: bool  # respond with a list


def _flag(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ValueError(f"{key} must be a boolean, got {v!r}")
    return v


def _prompts(body: dict, tokenizer: Tokenizer, vocab_size: int) -> tuple[list[list[int]], bool]:
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise ValueError("give exactly one of `text` or `input_ids`")
    if has_text:
        text = body["text"]
        if isinstance(text, str):
            return [tokenizer.encode(text).ids], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [tokenizer.encode(t).ids for t in text], True
        raise ValueError("`text` must be a string or a non-empty list of strings")
    ids = body["input_ids"]
    is_batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    prompts = ids if is_batch else [ids]
    for p in prompts:
        if not isinstance(p, list) or not p:
            raise ValueError("`input_ids` must be a non-empty list of token ids (or a list of such lists)")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in p):
            raise ValueError(f"`input_ids` must hold integers in [0, {vocab_size})")
    return prompts, is_batch


def _logprob_start(value: Any, prompt_len: int) -> int:
    """A valid ``logprob_start_len`` for a prompt of ``prompt_len`` tokens (-1: output logprobs only)."""
    if value is None:
        return -1
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(
            f"`logprob_start_len` must be an integer >= 0, or -1 for output logprobs only; got {value!r}"
        )
    if value >= prompt_len:
        raise ValueError(f"`logprob_start_len` ({value}) must be less than the prompt's {prompt_len} tokens "
                         "(input_token_logprobs start at that prompt position)")
    return value


def _per_item(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"`{name}` has {len(value)} items for {count} prompts")
        return value
    return [value] * count


def parse_generate(
    body: Any, tokenizer: Tokenizer, *, vocab_size: int, max_positions: int
) -> tuple[list[RequestSpec], GenerateOptions]:
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    for key, default in _UNSUPPORTED.items():
        if body.get(key) not in (default, None):
            raise ValueError(f"`{key}` is not supported by the embedded engine")
    prompts, is_batch = _prompts(body, tokenizer, vocab_size)
    for p in prompts:
        if len(p) >= max_positions:
            raise ValueError(f"the prompt has {len(p)} tokens; the model's context is {max_positions}")
    rid = body.get("rid")
    rids = _per_item(rid, len(prompts), "rid")
    if is_batch and not isinstance(rid, list):
        base = rid or uuid.uuid4().hex
        rids = [f"{base}_{i}" for i in range(len(prompts))]
    params = [
        parse_sampling_params(sp)
        for sp in _per_item(body.get("sampling_params"), len(prompts), "sampling_params")
    ]
    top_n = body.get("top_logprobs_num", 0) or 0
    if isinstance(top_n, bool) or not isinstance(top_n, int) or not 0 <= top_n <= vocab_size:
        raise ValueError("`top_logprobs_num` must be an integer >= 0")
    loras = _per_item(body.get("lora_path"), len(prompts), "lora_path")
    if not all(x is None or (isinstance(x, str) and x) for x in loras):
        raise ValueError("`lora_path` must be the name of a loaded LoRA adapter (or a list of such names)")
    return_logprob = _flag(body, "return_logprob")
    # As SGLang: without return_logprob, logprob_start_len is not read.
    raw_starts = _per_item(body.get("logprob_start_len"), len(prompts), "logprob_start_len")
    starts = [_logprob_start(v, len(p)) if return_logprob else -1 for v, p in zip(raw_starts, prompts, strict=True)]
    specs: list[RequestSpec] = []
    for prompt, r, p, lora, start in zip(prompts, rids, params, loras, starts, strict=True):
        r = r if r is not None else uuid.uuid4().hex
        if not isinstance(r, str):
            raise ValueError("`rid` must be a string")
        for i in range(p.n):
            seed = None if p.sampling_seed is None else p.sampling_seed + i
            specs.append(RequestSpec(r if p.n == 1 else f"{r}_{i}", list(prompt), p, seed, lora, start))
    opts = GenerateOptions(
        return_logprob=return_logprob,
        top_logprobs_num=top_n,
        return_text_in_logprobs=_flag(body, "return_text_in_logprobs"),
        return_prompt_token_ids=_flag(body, "return_prompt_token_ids"),
        stream=_flag(body, "stream"),
        is_batch=is_batch or len(specs) > 1,
    )
    return specs, opts
