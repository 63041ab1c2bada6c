"""One generation request as the scheduler sees it, and how it becomes SGLang's response JSON."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenizers import Tokenizer

from tracegym.trainer.engine.sampling import SamplingParams, find_stop_string

ABORTED = "Aborted"
ABORTED_WAITING = "Abort in waiting queue"


@dataclass
class GenRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    stop_ids: frozenset[int]
    return_logprob: bool = False
    top_logprobs_num: int = 0
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
    prefilled: bool = False
    stop_text: tuple[int, str] | None = None  # (index in text, matched) when a stop string ended it
    created: float = field(default_factory=time.monotonic)

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
            text = tokenizer.decode(self.output_ids, skip_special_tokens=p.skip_special_tokens)
            hit = find_stop_string(text, p)
            if hit is not None:
                self.stop_text = hit
                self.finish_reason = {"type": "stop", "matched": hit[1]}
                return
        if n >= p.max_new_tokens or len(self.input_ids) + n >= max_positions:
            self.finish_reason = {"type": "length", "length": n}

    def text(self, tokenizer: Tokenizer) -> str:
        """Output text: a matched stop token id is dropped, a stop string is trimmed (unless
        ``no_stop_trim``)."""
        p = self.params
        ids = self.output_ids
        matched = (self.finish_reason or {}).get("matched")
        trim = not p.no_stop_trim
        if trim and isinstance(matched, int) and ids and ids[-1] == matched:
            ids = ids[:-1]
        text = tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
        if trim and self.stop_text is not None:
            text = text[: self.stop_text[0]]
        return text

    def to_json(self, tokenizer: Tokenizer, weight_version: str, final: bool) -> dict[str, Any]:
        """SGLang's ``/generate`` response object (also each cumulative stream chunk)."""
        meta: dict[str, Any] = {"id": self.rid, "finish_reason": self.finish_reason if final else None}
        aborted_in_queue = (self.finish_reason or {}).get("message") == ABORTED_WAITING
        if not aborted_in_queue:
            meta["prompt_tokens"] = len(self.input_ids)
        meta.update(
            completion_tokens=len(self.output_ids),
            cached_tokens=0,
            weight_version=weight_version,
            e2e_latency=time.monotonic() - self.created,
        )
        if self.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [
                [lp, tid, self._tok_text(tokenizer, tid)]
                for lp, tid in zip(self.logprobs, self.output_ids, strict=True)
            ]
            meta["output_token_logprobs_length"] = len(self.output_ids)
            if self.top_logprobs_num > 0:
                meta["input_top_logprobs"] = []
                meta["output_top_logprobs"] = [
                    [[lp, tid, self._tok_text(tokenizer, tid)] for lp, tid in row] for row in self.top
                ]
        out: dict[str, Any] = {
            "text": self.text(tokenizer),
            "output_ids": list(self.output_ids),
            "meta_info": meta,
        }
        if self.return_prompt_token_ids:
            out["prompt_token_ids"] = list(self.input_ids)
        return out

    def _tok_text(self, tokenizer: Tokenizer, tid: int) -> str | None:
        if not self.return_text_in_logprobs:
            return None
        return tokenizer.decode([tid], skip_special_tokens=False)
