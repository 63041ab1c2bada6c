"""Typed contracts shared by the gateway, the trainer and users: plain dataclasses, no heavy imports.

Stages: a gateway call becomes a ``CallRecord`` (stored as one OpenTelemetry span), a rollout's calls
become a ``Trajectory`` of ``Sequence``s, and the trainer turns trajectories into its batch input.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Drift = Literal["none", "clean", "realigned", "forked"]
"""Prefix-reuse status of a call's prompt within its rollout.

- ``none``: no earlier call of the rollout was a prefix; the prompt was rendered and tokenized whole.
- ``clean``: the prompt reuses an earlier call's exact prompt+output ids, and re-rendering the messages
  gives the same ids (no drift).
- ``realigned``: the prompt reuses the earlier ids, but the re-render of those messages differs; the
  reused (sampled) ids were kept and the suffix was tokenized on its own.
- ``forked``: the messages extend an earlier call's conversation but the earlier reply was edited, so
  the prompt was rendered whole and starts a new sequence.
"""

RolloutStatus = Literal["queued", "running", "completed", "failed", "adhoc"]


@dataclass(slots=True)
class WeightVersionSpan:
    """Output tokens ``[start, end)`` of one choice were sampled with weights ``version``."""

    version: str
    start: int
    end: int


@dataclass(slots=True)
class ChoiceRecord:
    """One sampled completion of a call (a call with ``n`` > 1 has several)."""

    index: int
    output_ids: list[int] | None
    """Exact sampled token ids, or None when the upstream could not return ids."""
    output_logprobs: list[float] | None
    """The engine's logprob of each sampled token (aligned with ``output_ids``)."""
    finish_reason: str | None
    message: dict[str, Any] | None
    """The OpenAI message (chat) or ``{"text": ...}`` (completions) returned to the client."""
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)


@dataclass(slots=True)
class CallRecord:
    """Everything the gateway knows about one LLM call; stored as one span."""

    call_id: str
    """The response id returned to the client (``chatcmpl-...`` / ``cmpl-...``)."""
    rollout_id: str
    operation: Literal["chat", "text_completion"]
    model: str
    upstream_kind: str
    """``sglang`` | ``openai`` | ``litellm``."""
    request: dict[str, Any]
    """The request body as received (messages, tools, sampling parameters)."""
    choices: list[ChoiceRecord]
    prompt_ids: list[int] | None
    task_id: str | None = None
    agent_name: str | None = None
    weight_version: str | None = None
    """The upstream's weight version when the call finished."""
    drift: Drift = "none"
    prefix_len: int = 0
    """How many leading prompt ids were reused from an earlier call of the rollout."""
    retokenized: bool = False
    """True when the ids were not returned by the upstream but re-derived (or are missing)."""
    input_tokens: int = 0
    output_tokens: int = 0
    start_time_ns: int = 0
    end_time_ns: int = 0
    first_token_time_ns: int | None = None
    status: Literal["ok", "error"] = "ok"
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Sequence:
    """One training sequence: a prompt and the sampled tokens that extend it, masked.

    ``loss_mask[i] == 1`` exactly on tokens the policy sampled; ``logprobs[i]`` is the engine's logprob
    there and None elsewhere.
    """

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float | None]
    agent_name: str | None = None
    weight_versions: list[str] = field(default_factory=list)
    call_ids: list[str] = field(default_factory=list)
    """The calls whose sampled tokens this sequence trains (mask 1), in order."""
    choice_indices: list[int] = field(default_factory=list)
    """The choice of each entry of ``call_ids`` (a call with ``n`` > 1 appears once per choice)."""
    retokenized: bool = False
    reward: float | None = None
    """This sequence's reward (the rollout reward, possibly discounted per sequence)."""
    step_rewards: list[dict[str, Any]] = field(default_factory=list)
    """Rewards emitted during this sequence's calls: ``{"value", "name", "call_index"}``."""


@dataclass(slots=True)
class Trajectory:
    rollout_id: str
    task_id: str | None
    reward: float | None
    sequences: list[Sequence]
    group_id: str | None = None
    status: str | None = None
    excluded: list[dict[str, Any]] = field(default_factory=list)
    """Call choices left out of every sequence: ``{"call_id", "choice_index", "reason"}`` with reason
    ``agent`` (not matched by ``agent_match``), ``no_ids``, ``error`` or ``retokenized``."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        fields = Sequence.__dataclass_fields__
        seqs = [Sequence(**{k: v for k, v in s.items() if k in fields}) for s in d.get("sequences", [])]
        return cls(
            rollout_id=d["rollout_id"],
            task_id=d.get("task_id"),
            reward=d.get("reward"),
            sequences=seqs,
            group_id=d.get("group_id"),
            status=d.get("status"),
            excluded=list(d.get("excluded") or []),
        )
