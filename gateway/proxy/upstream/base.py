"""The one interface every inference upstream implements.

Two families:
- token-native (``sglang``, also serving the embedded engine): the gateway renders the prompt ids
  itself and the upstream returns exact output ids + logprobs (``Upstream.token_native`` is True);
- message-based (``openai``, ``litellm``): the gateway forwards the OpenAI request and the upstream
  answers with messages; ids come back only where the server supports it, otherwise the call is
  marked ``retokenized``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from tracegym.types import WeightVersionSpan

Operation = Literal["chat", "text_completion"]


@dataclass(slots=True)
class SamplingParams:
    """OpenAI sampling parameters, already validated; adapters map them to their upstream's names."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    top_k: int | None = None
    """Sample among the ``top_k`` most likely tokens (None: all)."""


@dataclass(slots=True)
class GenerateRequest:
    rid: str
    operation: Operation
    sampling: SamplingParams
    input_ids: list[int] | None = None
    """Token-native upstreams: the exact prompt ids."""
    body: dict[str, Any] | None = None
    """Message-based upstreams: the OpenAI request body to forward (``messages``/``prompt``, tools, ...)."""
    logprobs: bool = False
    top_logprobs: int = 0
    route_key: str | None = None
    """The rollout id the call belongs to (None: unattributed); a fleet keeps a rollout on one engine."""
    served_by: str | None = None
    """Written by ``fleet.UpstreamFleet``: the URL of the engine that answered (the last one, when a
    call moved), recorded on the span as ``tracegym.upstream``."""
    adapter: str | None = None
    """The LoRA adapter (logical name, ``upstream/adapter_table.py``) that serves this call; None = the base."""
    prompt_logprobs: int | None = None
    """vLLM's ``prompt_logprobs`` (token-native upstreams): every prompt token's logprob, with this many top
    alternatives at each position; None: not asked for."""


@dataclass(slots=True)
class TopLogprob:
    token_id: int | None
    logprob: float
    text: str | None = None


@dataclass(slots=True)
class PromptLogprobs:
    """The prompt tokens' logprobs, one entry per prompt token: the logprob of ``token_ids[i]`` given the
    tokens before it (None for the first, which has no context), and with ``top`` the most likely tokens at
    that position, most likely first."""

    token_ids: list[int]
    logprobs: list[float | None]
    top: list[list[TopLogprob] | None] | None = None


@dataclass(slots=True)
class GenChoice:
    """One sampled completion (final, or the delta of one stream event)."""

    index: int
    output_ids: list[int] | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    text: str | None = None
    """Text as the upstream returned it (message-based upstreams; token-native ones are decoded by the
    gateway with the model's tokenizer)."""
    message: dict[str, Any] | None = None
    """Message-based chat upstreams: the assistant message (content, tool_calls) as returned."""
    tool_call_deltas: list[dict[str, Any]] | None = None
    """Message-based streams: ``delta.tool_calls`` entries as the upstream sent them."""
    finish_reason: str | None = None
    """``stop`` | ``length`` | ``abort`` | ``tool_calls`` | None while unfinished."""
    stop_matched: str | None = None
    """A stop *string* that ended the choice (its tokens are in output_ids; the text is trimmed)."""
    error: str | None = None
    weight_versions: list[WeightVersionSpan] | None = None
    """Which output tokens came from which weight version, when a choice spans a weight swap (set on
    the final result, or a stream's final event, of a continued choice); None means all came from the
    result's ``weight_version``."""


@dataclass(slots=True)
class GenerateResult:
    choices: list[GenChoice]
    prompt_tokens: int = 0
    prompt_ids: list[int] | None = None
    weight_version: str | None = None
    retokenized: bool = False
    completion_tokens: int = 0
    """As the upstream reported it (used when it returned no ids)."""
    prompt_logprobs: PromptLogprobs | None = None
    """When the request asked for them (``GenerateRequest.prompt_logprobs``)."""


@dataclass(slots=True)
class StreamEvent:
    """A delta for one choice: the new ids/logprobs/text since the previous event of that choice; or,
    with ``choice`` None, only the token counts an OpenAI-compatible server sends in its final usage
    chunk."""

    choice: GenChoice | None
    prompt_tokens: int | None = None
    prompt_ids: list[int] | None = None
    weight_version: str | None = None
    completion_tokens: int | None = None
    more: bool = False
    """More events, or the stream's end, were received with this one (``http.sse_events``): a stream writer
    may hold its output for theirs, or for its closing, and send them in one write."""


@dataclass(slots=True)
class ModelInfo:
    served_model_name: str | None
    tokenizer_path: str | None
    model_path: str | None = None
    weight_version: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)


class Upstream(ABC):
    kind: str
    token_native: bool

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Called once by the app's lifespan before serving (slow imports, warm-up)."""

    @abstractmethod
    async def generate(self, req: GenerateRequest) -> GenerateResult: ...

    @abstractmethod
    def stream(self, req: GenerateRequest) -> AsyncIterator[StreamEvent]:
        """Deltas per choice; a choice's last event carries its ``finish_reason``. Closing the iterator
        early (client gone) must cancel the upstream request."""

    @abstractmethod
    async def model_info(self) -> ModelInfo: ...

    @abstractmethod
    async def health(self) -> dict[str, Any]:
        """``{"reachable": bool, ...}``; never raises for an unreachable upstream."""

    async def abort(self, rid: str) -> None:  # noqa: B027 - optional for upstreams without aborts
        """Ask the upstream to stop ``rid`` (best effort; closing the connection also aborts)."""

    @abstractmethod
    async def close(self) -> None: ...
