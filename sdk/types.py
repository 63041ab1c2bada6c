"""Typed contracts shared by the gateway, the trainer and users: plain dataclasses, no heavy imports.

Stages: a gateway call becomes a ``CallRecord`` (stored as one OpenTelemetry span), a rollout's calls
become a ``Trajectory`` of ``Sequence``s, and the trainer turns trajectories into its batch input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from tracegym.arrays import TokenArrays

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

Api = Literal["chat", "completions", "responses", "messages"]
"""The public API a call came in through: OpenAI Chat Completions, Completions, Responses, or Anthropic
Messages. All of them run the same token-exact call (Responses and Messages as ``operation`` chat)."""


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
    """Everything the gateway knows about one LLM call; stored as one span. (The gateway's assembly reads a
    stored call as a ``TokenCall``: its token arrays and the few fields a trajectory needs.)"""

    call_id: str
    """The response id returned to the client (``chatcmpl-...``, ``cmpl-...``, ``resp_...``, ``msg_...``)."""
    rollout_id: str
    operation: Literal["chat", "text_completion"]
    model: str
    upstream_kind: str
    """``sglang`` | ``openai`` | ``litellm``."""
    request: dict[str, Any]
    """The request body as received (messages, tools, sampling parameters). For the Responses and Messages
    APIs: the Chat Completions body the call was translated to (the whole conversation, so prefix reuse
    reads it as any chat call), with the body as received under ``tracegym_source``
    (``{"api", "request"}``)."""
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
    api: Api | None = None
    """The public API of the call (span attribute ``tracegym.api``); None on records stored before it was
    kept, whose ``operation`` tells (chat or text_completion)."""
    tool_parse: str | None = None
    """How the gateway's parse of the reply's tool-call syntax went (span attribute ``tracegym.tool_parse``):
    ``ok`` (calls parsed), ``none`` (no tool-call block), ``failed: <reason>`` (a block that is no valid
    call, e.g. half-written JSON or an unknown tool: it stays in the text); None when tools were not parsed
    (no tools in the request, ``tool_choice: none``, or an upstream that parses them itself)."""
    upstream: str | None = None
    """The URL of the engine that answered (span attribute ``tracegym.upstream``); None on records
    stored before it was kept, or from an upstream without URL."""
    lora_adapter: str | None = None
    """The LoRA adapter that served the call (span attribute ``tracegym.lora_adapter``; the version of
    each token is in ``weight_versions``), None for the base model."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _ListField:
    """A ``Sequence`` field kept as given (a list, or a numpy array from the assembly) in the slot
    ``_<name>`` and read as a list, made once on first read (``nan_is_none``: NaN values read as None)."""

    def __init__(self, *, nan_is_none: bool = False) -> None:
        self.nan_is_none = nan_is_none
        self.slot = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        v = getattr(obj, self.slot)
        if type(v) is not list:
            v = v.tolist()
            if self.nan_is_none:
                v = [None if x != x else x for x in v]
            setattr(obj, self.slot, v)
        return v

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj, self.slot, value)


class Sequence:
    """One training sequence: a prompt and the sampled tokens that extend it, masked.

    ``loss_mask[i] == 1`` exactly on tokens the policy sampled; ``logprobs[i]`` is the engine's logprob
    there and None elsewhere.

    ``token_ids``, ``loss_mask`` and ``logprobs`` read as lists: the public form, as in JSON. A NaN logprob
    reads as None (JSON has no NaN either: it is written as null). In memory the gateway and the trainer
    work on numpy arrays (``tracegym.arrays``): the assembly builds a sequence from them, and ``arrays()``
    gives them whatever the sequence holds. The list of an array-built field is made on its first read, once.

    ``call_ids``: the calls whose sampled tokens this sequence trains (mask 1), in order;
    ``choice_indices``: the choice of each (a call with ``n`` > 1 appears once per choice); ``reward``: the
    rollout reward, possibly discounted per sequence; ``step_rewards``: rewards emitted during this
    sequence's calls, ``{"value", "name", "call_index"}``.
    """

    __slots__ = (
        "_checked",
        "_logprobs",
        "_loss_mask",
        "_token_ids",
        "agent_name",
        "call_ids",
        "choice_indices",
        "retokenized",
        "reward",
        "step_rewards",
        "weight_versions",
    )
    FIELDS = ("token_ids", "loss_mask", "logprobs", "agent_name", "weight_versions", "call_ids",
              "choice_indices", "retokenized", "reward", "step_rewards")
    """The fields, in JSON order (``to_dict``, ``Trajectory.from_dict``)."""

    def __init__(
        self,
        token_ids: Any,
        loss_mask: Any,
        logprobs: Any,
        agent_name: str | None = None,
        weight_versions: list[str] | None = None,
        call_ids: list[str] | None = None,
        choice_indices: list[int] | None = None,
        retokenized: bool = False,
        reward: float | None = None,
        step_rewards: list[dict[str, Any]] | None = None,
    ) -> None:
        self._token_ids = token_ids
        self._loss_mask = loss_mask
        self._logprobs = logprobs
        self._checked: TokenArrays | None = None
        self.agent_name = agent_name
        self.weight_versions: list[str] = [] if weight_versions is None else weight_versions
        self.call_ids: list[str] = [] if call_ids is None else call_ids
        self.choice_indices: list[int] = [] if choice_indices is None else choice_indices
        self.retokenized = retokenized
        self.reward = reward
        self.step_rewards: list[dict[str, Any]] = [] if step_rewards is None else step_rewards

    token_ids: list[int] = _ListField()  # type: ignore[assignment]
    loss_mask: list[int] = _ListField()  # type: ignore[assignment]
    logprobs: list[float | None] = _ListField(nan_is_none=True)  # type: ignore[assignment]

    @classmethod
    def from_arrays(cls, arrays: TokenArrays, *args: Any, **kwargs: Any) -> Sequence:
        """A sequence of ``arrays``, already in ``tracegym.arrays``' types (made by ``token_arrays``, or
        built in those types, as the assembly does): ``arrays()`` hands them out without checking them
        again. ``args``/``kwargs``: the other fields, as for the constructor."""
        seq = cls(*arrays, *args, **kwargs)
        seq._checked = arrays
        return seq

    def arrays(self) -> TokenArrays:
        """``(token_ids, loss_mask, logprobs)`` as numpy arrays (``tracegym.arrays``: needs numpy, which the
        gateway and trainer extras bring). Arrays the sequence holds in those types are returned as they
        are, shared (the assembly's: modifying them modifies the sequence), and checked once; lists (given,
        parsed from JSON, or read) are converted on each call, so call it once and keep the result.
        ValueError for values that are no token arrays or lengths that differ."""
        ids, mask, lps = self._token_ids, self._loss_mask, self._logprobs
        c = self._checked
        if c is not None and c.token_ids is ids and c.loss_mask is mask and c.logprobs is lps:
            return c  # the route checks a sequence's arrays, then writes them: one check
        arrays = _token_arrays()(ids, mask, lps)
        if arrays.token_ids is ids and arrays.loss_mask is mask and arrays.logprobs is lps:
            self._checked = arrays
        # Converted lists are not kept in place of the held ones: a caller may hold the list and edit it.
        return arrays

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict of plain Python values (lists), in ``FIELDS`` order."""
        return {name: _plain(getattr(self, name)) for name in self.FIELDS}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in self.FIELDS)

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it replaces

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.FIELDS)
        return f"Sequence({inner})"


@cache
def _token_arrays() -> Callable[[Any, Any, Any], TokenArrays]:
    """``tracegym.arrays.token_arrays``, imported on first use: it needs numpy, which ``import tracegym``
    never loads. (Cached: an import statement per ``Sequence.arrays`` call costs more than the call.)"""
    from tracegym.arrays import token_arrays

    return token_arrays


def _plain(value: Any) -> Any:
    """Lists and dicts copied (as ``dataclasses.asdict`` does), other values as they are."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


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
        d = {name: _plain(getattr(self, name)) for name in self.__dataclass_fields__}
        d["sequences"] = [s.to_dict() for s in self.sequences]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        fields = Sequence.FIELDS
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
