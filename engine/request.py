"""One generation request as the scheduler sees it, and how it becomes SGLang's response JSON."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenizers import Tokenizer

from tracegym.engine.sampling import SamplingParams, find_stop_string

ABORTED = "Aborted"
ABORTED_WAITING = "Abort in waiting queue"
_TAIL_MARGIN_CHARS = 16


@dataclass(frozen=True)
class Snapshot:
    """A request's state at one update, taken on the model thread in O(1); the response JSON is built
    from it later on another thread (the request's lists only grow, so their first ``n`` items are
    stable)."""

    n: int  # output tokens so far
    final: bool
    finish_reason: dict[str, Any] | None
    stop_text: tuple[int, str] | None
    weight_version: str
    e2e_latency: float


@dataclass
class GenRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    stop_ids: frozenset[int]
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    """Prompt logprobs from this position on (with ``return_logprob``); -1: none."""
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    stream: bool = False
    # Called from the scheduler thread with (request, is_final) after new tokens / at the end.
    on_update: Callable[[GenRequest, bool], None] = lambda r, final: None
    seq: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[float, int]]] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    stop_text: tuple[int, str] | None = None  # (index in text, matched) when a stop string ended it
    created: float = field(default_factory=time.monotonic)
    adapter: Any = None  # the LoRA adapter (``engine.lora.Adapter``) this request samples with
    input_logprobs: list[float | None] | None = None
    """Set once at prefill when ``scores_prompt``: the logprobs of ``input_ids[logprob_start_len:]`` (the first
    None), as ``sampling.prompt_logprobs`` gives them; never changed after."""
    input_top: list[list[tuple[float, int]] | None] | None = None
    """With ``top_logprobs_num``: the top alternatives at each of those positions (the first None)."""

    @property
    def scores_prompt(self) -> bool:
        """Prompt logprobs were asked for (``return_logprob`` with ``logprob_start_len`` >= 0)."""
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def banned_ids(self) -> tuple[int, ...]:
        """Stop ids may not be sampled before ``min_new_tokens``."""
        if len(self.output_ids) < self.params.min_new_tokens:
            return tuple(self.stop_ids)
        return ()

    def abort(self, message: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = {"type": "abort", "message": message, "status_code": None, "err_type": None}

    def append(self, token: int, logprob: float, top: list[tuple[float, int]] | None) -> None:
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        if top is not None:
            self.top.append(top)

    def check_finish(self, tokenizer: Tokenizer, max_positions: int) -> None:
        """Set ``finish_reason`` after a token was appended: stop id, stop string/regex, length."""
        p = self.params
        tok = self.output_ids[-1]
        n = len(self.output_ids)
        if tok in self.stop_ids:
            self.finish_reason = {"type": "stop", "matched": tok}
            return
        if (p.stop or p.stop_regex) and n >= p.min_new_tokens:
            hit = self._find_stop(tokenizer, n - 1 >= p.min_new_tokens)
            if hit is not None:
                self.stop_text = hit
                self.finish_reason = {"type": "stop", "matched": hit[1]}
                return
        if n >= p.max_new_tokens or len(self.input_ids) + n >= max_positions:
            self.finish_reason = {"type": "length", "length": n}

    def _find_stop(self, tokenizer: Tokenizer, checked_before: bool) -> tuple[int, str] | None:
        """The stop string/regex match in the output text, if any. When the text without the last token
        was already checked and only stop strings are set, a new match must end in the last few
        characters, so only a tail window of tokens is decoded (O(longest stop string) per token, not
        O(output)); a hit there is confirmed on the full text, which gives its exact index."""
        p = self.params
        skip = p.skip_special_tokens
        ids = self.output_ids
        if checked_before and not p.stop_regex:
            longest = max(len(s) for s in p.stop)
            # Margin for what decoding a suffix changes at its start (a split UTF-8 character, a stripped
            # leading space) and for what the last token changes before it.
            need = longest + _TAIL_MARGIN_CHARS
            width = 4 * longest + _TAIL_MARGIN_CHARS
            while width < len(ids):
                tail = tokenizer.decode(ids[-width:], skip_special_tokens=skip)
                if len(tail) >= need:
                    if all(s not in tail for s in p.stop):
                        return None
                    break
                width *= 2
        return find_stop_string(tokenizer.decode(ids, skip_special_tokens=skip), p)

    def text(self, tokenizer: Tokenizer, snap: Snapshot | None = None) -> str:
        """Output text: a matched stop token id is dropped, a stop string is trimmed (unless
        ``no_stop_trim``)."""
        snap = snap or self.snapshot("", True)
        p = self.params
        ids = self.output_ids[: snap.n]
        matched = (snap.finish_reason or {}).get("matched")
        trim = not p.no_stop_trim
        if trim and isinstance(matched, int) and ids and ids[-1] == matched:
            ids = ids[:-1]
        text = tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
        if trim and snap.stop_text is not None:
            text = text[: snap.stop_text[0]]
        return text

    def snapshot(self, weight_version: str, final: bool) -> Snapshot:
        return Snapshot(
            n=len(self.output_ids),
            final=final,
            finish_reason=self.finish_reason,
            stop_text=self.stop_text,
            weight_version=weight_version,
            e2e_latency=time.monotonic() - self.created,
        )

    def to_json(self, tokenizer: Tokenizer, weight_version: str, final: bool) -> dict[str, Any]:
        """SGLang's ``/generate`` response object (also each cumulative stream chunk)."""
        return self.render(tokenizer, self.snapshot(weight_version, final))

    def render(
        self, tokenizer: Tokenizer, snap: Snapshot, memo: dict[str, list] | None = None
    ) -> dict[str, Any]:
        """``to_json`` as of ``snap``. Successive chunks of one stream may share a ``memo``, so each logprob
        entry is built once."""
        n = snap.n
        fr = snap.finish_reason
        meta: dict[str, Any] = {"id": self.rid, "finish_reason": fr if snap.final else None}
        aborted_in_queue = (fr or {}).get("message") == ABORTED_WAITING
        if not aborted_in_queue:
            meta["prompt_tokens"] = len(self.input_ids)
        meta.update(
            completion_tokens=n,
            cached_tokens=0,
            reasoning_tokens=0,  # SGLang counts them only with a reasoning parser; this engine has none
            num_retractions=0,  # SGLang retracts under KV-cache pressure; this engine never does
            weight_version=snap.weight_version,
            e2e_latency=snap.e2e_latency,
        )
        output_ids = self.output_ids[:n]
        if self.return_logprob:
            memo = {} if memo is None else memo
            lps = memo.setdefault("lp", [])
            for lp, tid in zip(self.logprobs[len(lps) : n], output_ids[len(lps) :], strict=True):
                lps.append([lp, tid, self._tok_text(tokenizer, tid)])
            meta["input_token_logprobs"] = self._input_logprob_triples(tokenizer, memo)
            meta["output_token_logprobs"] = lps[:n]
            meta["output_token_logprobs_length"] = n
            if self.top_logprobs_num > 0:
                tops = memo.setdefault("top", [])
                for row in self.top[len(tops) : n]:
                    tops.append(self._triples(tokenizer, row))
                meta["input_top_logprobs"] = self._input_top_triples(tokenizer, memo)
                meta["output_top_logprobs"] = tops[:n]
        out: dict[str, Any] = {
            "text": self.text(tokenizer, snap),
            "output_ids": output_ids,
            "meta_info": meta,
        }
        if self.return_prompt_token_ids:
            out["prompt_token_ids"] = list(self.input_ids)
        return out

    def _input_logprob_triples(self, tokenizer: Tokenizer, memo: dict[str, list]) -> list:
        """``input_token_logprobs``: ``[logprob, id, text]`` of each prompt token from ``logprob_start_len`` on
        (``[]`` when not asked for, or before the prefill)."""
        if self.input_logprobs is None:
            return []
        if "in" not in memo:
            ids = self.input_ids[self.logprob_start_len :]
            memo["in"] = [[lp, tid, self._tok_text(tokenizer, tid)]
                          for lp, tid in zip(self.input_logprobs, ids, strict=True)]
        return memo["in"]

    def _input_top_triples(self, tokenizer: Tokenizer, memo: dict[str, list]) -> list:
        if self.input_top is None:
            return []
        if "in_top" not in memo:
            memo["in_top"] = [None if row is None else self._triples(tokenizer, row) for row in self.input_top]
        return memo["in_top"]

    def _triples(self, tokenizer: Tokenizer, row: list[tuple[float, int]]) -> list[list]:
        return [[lp, tid, self._tok_text(tokenizer, tid)] for lp, tid in row]

    def _tok_text(self, tokenizer: Tokenizer, tid: int) -> str | None:
        if not self.return_text_in_logprobs:
            return None
        return tokenizer.decode([tid], skip_special_tokens=False)
