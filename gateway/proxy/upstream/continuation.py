"""Transparent continuation of choices a weight swap cut short (used by ``upstream/sglang.py``): the
pieces of one choice are joined (ids, logprobs, text, ``weight_versions`` spans), and the re-post of an
aborted choice asks for the rest of its token budget with ``input_ids = prompt + output so far``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tracegym.gateway.openai_errors import OpenAIError
from tracegym.gateway.proxy.upstream.base import GenChoice, GenerateRequest, TopLogprob
from tracegym.types import WeightVersionSpan

MAX_CONTINUATIONS = 8
"""Swap-aborts one choice may be continued through before the call fails (503)."""
DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's (and the embedded engine's) ``max_new_tokens`` when a request sets none: the budget a
continuation of such a request shares."""


def extend_spans(spans: list[WeightVersionSpan], version: str | None, start: int, end: int) -> None:
    """Record output tokens ``[start, end)`` as sampled with ``version`` (adjacent equal versions merge)."""
    if end <= start or version is None:
        return
    if spans and spans[-1].version == version and spans[-1].end == start:
        spans[-1].end = end
    else:
        spans.append(WeightVersionSpan(version, start, end))


@dataclass(slots=True)
class JoinedChoice:
    """One choice assembled from the segments of its continuations."""

    index: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[TopLogprob]] | None = None
    text: str = ""
    spans: list[WeightVersionSpan] = field(default_factory=list)
    continuations: int = 0

    def add(self, ch: GenChoice, version: str | None) -> None:
        start = len(self.ids)
        self.ids.extend(ch.output_ids or ())
        self.logprobs.extend(ch.logprobs or ())
        if ch.top_logprobs:
            if self.tops is None:
                self.tops = []
            self.tops.extend(ch.top_logprobs)
        self.text += ch.text or ""
        extend_spans(self.spans, version, start, len(self.ids))

    def final(self, finish: str | None, stop_matched: str | None) -> GenChoice:
        return GenChoice(index=self.index, output_ids=self.ids, logprobs=self.logprobs or None,
                         top_logprobs=self.tops, text=self.text, finish_reason=finish, stop_matched=stop_matched,
                         weight_versions=list(self.spans))


def continuation_request(req: GenerateRequest, joined: JoinedChoice) -> GenerateRequest | None:
    """The re-post of an aborted choice (None when its token budget is already spent)."""
    if req.input_ids is None:
        raise ValueError("the sglang upstream needs input_ids")
    budget = req.sampling.max_tokens if req.sampling.max_tokens is not None else DEFAULT_MAX_NEW_TOKENS
    remaining = budget - len(joined.ids)
    if remaining <= 0:
        return None
    sampling = dataclasses.replace(req.sampling, max_tokens=remaining, n=1,
                                   stop=list(req.sampling.stop), stop_token_ids=list(req.sampling.stop_token_ids))
    suffix = f"-c{joined.continuations}" if req.sampling.n <= 1 else f"-{joined.index}-c{joined.continuations}"
    # Prompt logprobs come from the first prefill of the prompt: a re-post asks for them again only while
    # nothing was generated yet (its input is still the prompt alone).
    return dataclasses.replace(req, rid=req.rid + suffix, sampling=sampling,
                               input_ids=[*req.input_ids, *joined.ids],
                               prompt_logprobs=None if joined.ids else req.prompt_logprobs)


def too_many_continuations(rid: str) -> OpenAIError:
    return OpenAIError(503, f"request {rid} was interrupted by {MAX_CONTINUATIONS} weight swaps in a row and "
                            "not continued further", code="weight_swap_interrupted")
