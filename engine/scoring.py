"""Prompt logprobs at prefill (SGLang's ``return_logprob`` with ``logprob_start_len`` >= 0): which requests
need the prefill's logits beyond its last position, and the logprobs read from a forward that keeps them.

A request that does not ask is prefilled as before, keeping only the last position's logits. The asking
ones are prefilled in a forward of their own that keeps the logits of the positions they ask for; among
them, requests with the same prompt, start, top-k and adapter (the ``n`` samples of one prompt) are
prefilled once with those logits and the others take a copy of its result, their own prefill keeping the
last position only. The engine keeps no prefix cache: every prompt is prefilled whole, so no position
whose logprob was asked for is ever skipped."""

from __future__ import annotations

import torch

from tracegym.engine.request import GenRequest
from tracegym.engine.sampling import prompt_logprobs


def scoring_plan(
    reqs: list[GenRequest],
) -> tuple[list[GenRequest], list[GenRequest], list[tuple[GenRequest, GenRequest]]]:
    """``(plain, scored, copies)``: ``scored`` holds the first request of each distinct (adapter, prompt,
    start, top-k) among those asking for prompt logprobs; ``copies`` pairs each other asking request with
    the scored one whose logprobs it takes; ``plain`` holds every request not in ``scored``, in order."""
    first: dict[tuple, GenRequest] = {}
    copies: list[tuple[GenRequest, GenRequest]] = []
    for r in reqs:
        if not r.scores_prompt:
            continue
        key = (id(r.adapter), r.logprob_start_len, r.top_logprobs_num, tuple(r.input_ids))
        if key in first:
            copies.append((r, first[key]))
        else:
            first[key] = r
    scored = list(first.values())
    chosen = {id(r) for r in scored}
    return [r for r in reqs if id(r) not in chosen], scored, copies


def kept_columns(scored: list[GenRequest]) -> int:
    """Logit columns a left-padded prefill of ``scored`` keeps so that every row has its asked positions."""
    return max(len(r.input_ids) - r.logprob_start_len for r in scored)


def fill_prompt_logprobs(
    scored: list[GenRequest], logits: torch.Tensor, copies: list[tuple[GenRequest, GenRequest]]
) -> None:
    """Set the prompt logprobs of ``scored`` from their prefill's ``logits[B, keep, V]``
    (``kv_batch.prefill_keep``), then hand them to ``copies``."""
    keep = logits.shape[1]
    for i, r in enumerate(scored):
        n = len(r.input_ids) - r.logprob_start_len
        r.input_logprobs, r.input_top = prompt_logprobs(
            logits[i, keep - n :], r.input_ids, r.logprob_start_len, r.top_logprobs_num
        )
    for r, source in copies:
        r.input_logprobs, r.input_top = source.input_logprobs, source.input_top
