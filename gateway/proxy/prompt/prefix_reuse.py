"""Token-exact prefix reuse within a rollout (DESIGN.md, "Token exactness").

When a chat request extends an earlier call of its rollout (that call's messages, then one of its
choices' reply, then new messages), the prompt is the earlier call's exact prompt ids + the sampled
output ids + the ids of the new part only. The new part is the text the full re-render has after the
point the sampled ids cover (for ChatML that starts with the ``\\n`` after ``<|im_end|>``, which the model
never sampled). Drift against the re-render is detected and reported, never hidden:

- ``clean``: reused ids + suffix ids == the full re-render tokenized whole.
- ``realigned``: the reused ids differ from the re-render (the model wrote a tool call with other
  whitespace, or sampled a non-canonical tokenization, or the template rewrites the earlier turn: Qwen3
  drops the ``<think>`` block of turns before the last user message); the reused ids are kept, the
  sampled reasoning included, and only what the re-render has after that turn is appended.
- ``forked``: the messages extend an earlier call's messages but not with its reply (edited reply,
  dropped history, changed tools), or the re-render cannot be cut after the reply (a template that
  refuses the probe message of ``_realign_by_probe``): rendered whole, a new sequence starts.
  ``parent_call_id`` names that earlier call.

A reply matches when it comes back as recorded (its reasoning as ``reasoning_content`` or as a
``<think>`` block in the content, which key alike), or without its reasoning (clients that drop it).
- ``none``: nothing earlier matches: rendered whole.

A request whose messages equal an earlier call's messages (a retry) reuses that call's prompt ids whole.

Cost: the drift check does not re-tokenize the history. A parent whose own prompt matched its
re-render stores where its text was last split by a special token; the check tokenizes only from
there (the last turn plus the new messages), which equals tokenizing the whole because the tokenizer
splits on special tokens first (``full_check=True`` tokenizes the whole instead, for tokenizers where
that does not hold, which is detected for Metaspace ``prepend_scheme="first"``).
"""

from __future__ import annotations

import json
import logging
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tracegym.gateway.proxy.prompt.reasoning import join_reasoning, split_reasoning
from tracegym.gateway.proxy.prompt.templating import (
    ChatTokenizer,
    check_template_kwargs,
    check_tool_choice,
    check_tools,
    content_text,
)
from tracegym.gateway.proxy.prompt.tools import parse_arguments
from tracegym.types import CallRecord

log = logging.getLogger(__name__)

MsgKey = tuple[str, str, tuple[tuple[str, str], ...], str | None]
_PROBE = "\x00tracegym-probe\x00"


@dataclass
class PromptPlan:
    prompt_ids: list[int]
    drift: str  # "none" | "clean" | "realigned" | "forked" (tracegym.types.Drift)
    prefix_len: int  # leading ids reused from the parent call
    parent_call_id: str | None
    prompt_text: str = ""  # the full re-render of the request's messages


# ------------------------------------------------------------------------------------------ comparisons


def _canonical_arguments(arguments: Any) -> str:
    parsed = parse_arguments(arguments)
    if isinstance(arguments, str) and parsed is arguments:  # not JSON: compared as sent
        return "raw:" + arguments
    return json.dumps(parsed, sort_keys=True, ensure_ascii=False)


def message_key(m: dict[str, Any]) -> MsgKey:
    """What must be equal for two messages to count as the same: role, content (with a
    ``reasoning_content`` written in as ``<think>``), calls, tool_call_id."""
    role, content, calls = m.get("role"), m.get("content"), m.get("tool_calls")
    text = content if isinstance(content, str) else content_text(content)
    reasoning = m.get("reasoning_content")
    return (
        "system" if role == "developer" else str(role),
        text if not isinstance(reasoning, str) else join_reasoning(reasoning, text),
        tuple(_call_key(c) for c in calls) if calls else (),
        m.get("tool_call_id"),
    )


def bare_key(m: dict[str, Any]) -> MsgKey | None:
    """The key of reply ``m`` sent back without its reasoning; None when it has none."""
    if isinstance(m.get("reasoning_content"), str):
        return message_key({**m, "reasoning_content": None})
    role, content, calls, tool_call_id = message_key(m)
    reasoning, text = split_reasoning(content)
    return None if reasoning is None else (role, text, calls, tool_call_id)


def _call_key(call: dict[str, Any]) -> tuple[str, str]:
    fn = call.get("function") or {}
    return str(fn.get("name")), _canonical_arguments(fn.get("arguments"))


_PLAIN_CONTEXT = json.dumps([None, "auto", {}], sort_keys=True)
"""``context_key`` of a call without tools, tool_choice or template kwargs (most calls: no JSON work)."""


def context_key(tools: Any, tool_choice: Any, kwargs: dict[str, Any]) -> str:
    """Everything besides the messages that changes the render: tools, tool_choice, template kwargs."""
    if not tools and not kwargs and (tool_choice is None or tool_choice == "auto"):
        return _PLAIN_CONTEXT
    return json.dumps(
        [check_tools(tools), check_tool_choice(tool_choice), kwargs], sort_keys=True, default=str
    )


def request_args(request: dict[str, Any]) -> tuple[list[dict[str, Any]], Any, dict[str, Any]]:
    """``(messages, tools, template kwargs)`` of an OpenAI chat body, as ``plan_chat`` takes them."""
    kwargs = check_template_kwargs(request.get("chat_template_kwargs"))
    kwargs["tool_choice"] = request.get("tool_choice")
    return request["messages"], request.get("tools"), kwargs


# ---------------------------------------------------------------------------------------------- storage


@dataclass(slots=True)
class _Choice:
    output_ids: array
    reply: MsgKey
    bare: MsgKey | None  # the reply without its reasoning (None: it has none)
    text: str  # the output ids decoded
    stop_text: str | None  # text of the final token when it is a stop token

    def matches(self, key: MsgKey) -> bool:
        return self.reply == key or self.bare == key


@dataclass(slots=True)
class _Call:
    call_id: str
    ctx: str
    messages: tuple[MsgKey, ...]
    prompt_ids: array
    text_len: int  # the prompt's re-render text: its length and hash
    text_hash: int
    clean: bool  # prompt_ids == encode(re-render)
    split_at: int  # offset just after the last special token of the re-render (0 if none)
    tail_len: int  # how many prompt ids encode text[split_at:]
    choices: list[_Choice]


@dataclass(slots=True)
class _Pending:
    prompt_ids: list[int]
    ctx: str
    text: str
    keys: tuple[MsgKey, ...]
    clean: bool


@dataclass(slots=True)
class _Rollout:
    calls: deque[_Call]
    pending: deque[_Pending] = field(default_factory=lambda: deque(maxlen=8))
    call_ids: set[str] = field(default_factory=set)  # of ``calls`` (kept in step as the deque drops its oldest)

    def add(self, call: _Call) -> None:
        if len(self.calls) == self.calls.maxlen:
            self.call_ids.discard(self.calls[0].call_id)
        self.calls.append(call)
        self.call_ids.add(call.call_id)


# ------------------------------------------------------------------------------------------------ cache


class PrefixCache:
    """Per-rollout memory of recent chat calls, bounded (LRU on rollouts, last N calls per rollout).

    Owned by the app's lifespan; called from the asyncio loop only. On a miss for a rollout,
    ``loader(rollout_id)`` (the store's CallRecords of that rollout, in order) rebuilds it once.
    Callers: ``plan = cache.plan_request(rid, body)`` (or ``plan_chat``) before the upstream call, then
    ``cache.remember(rid, record)`` with ``record.prompt_ids == plan.prompt_ids`` after it succeeded.
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        max_rollouts: int = 10_000,
        loader: Callable[[str], list[CallRecord]] | None = None,
        max_calls_per_rollout: int = 32,
        full_check: bool = False,
    ) -> None:
        if max_rollouts < 1 or max_calls_per_rollout < 1:
            raise ValueError("max_rollouts and max_calls_per_rollout must be >= 1")
        self.tok = tokenizer
        self.max_rollouts = max_rollouts
        self.max_calls = max_calls_per_rollout
        self.loader = loader
        self.full_check = full_check or not tokenizer.segmented
        self._split_tokens = list(tokenizer.template_split_tokens)
        self._rollouts: OrderedDict[str, _Rollout] = OrderedDict()
        self._trailer: str | bool | None = None  # None: not probed yet; False: unknown
        self.loads = 0  # how many times the loader was called (observability)

    def __len__(self) -> int:
        return len(self._rollouts)

    def __contains__(self, rollout_id: str) -> bool:
        return rollout_id in self._rollouts

    # ---- public API

    def plan_request(self, rollout_id: str, request: dict[str, Any]) -> PromptPlan:
        messages, tools, kwargs = request_args(request)
        return self.plan_chat(rollout_id, messages, tools, **kwargs)

    def plan_chat(
        self, rollout_id: str, messages: list[dict[str, Any]], tools: list | None, /, **template_kwargs: Any
    ) -> PromptPlan:
        tool_choice = template_kwargs.pop("tool_choice", None)
        if "add_generation_prompt" in template_kwargs:
            raise ValueError(
                "add_generation_prompt cannot be set: a chat completion always prompts the assistant"
            )
        ctx = context_key(tools, tool_choice, template_kwargs)
        text = self.tok.render(messages, tools=tools, tool_choice=tool_choice, **template_kwargs)
        keys = tuple(message_key(m) for m in messages)
        state = self._state(rollout_id)
        plan, keys = self._plan(state, ctx, text, keys, messages, tools, tool_choice, template_kwargs)
        plan.prompt_text = text
        state.pending.append(_Pending(plan.prompt_ids, ctx, text, keys, plan.drift != "realigned"))
        return plan

    def remember(self, rollout_id: str, record: CallRecord) -> None:
        """Keep a successful chat call as a possible parent (other calls are ignored)."""
        self._add(self._state(rollout_id), record)

    # ---- planning

    def _plan(
        self,
        state: _Rollout,
        ctx: str,
        text: str,
        keys: tuple[MsgKey, ...],
        messages: list[dict[str, Any]],
        tools: list | None,
        tool_choice: Any,
        kwargs: dict[str, Any],
    ) -> tuple[PromptPlan, tuple[MsgKey, ...]]:
        forked: _Call | None = None
        for call in reversed(state.calls):
            n = len(call.messages)
            if n > len(keys) or (n and call.messages[-1] != keys[n - 1]) or keys[:n] != call.messages:
                continue
            if call.ctx != ctx:
                forked = forked or call
                continue
            if n == len(keys):
                if call.text_len == len(text) and call.text_hash == hash(text):
                    ids = list(call.prompt_ids)
                    return PromptPlan(
                        ids, "clean" if call.clean else "realigned", len(ids), call.call_id
                    ), keys
                continue
            choice = next((ch for ch in call.choices if ch.matches(keys[n])), None)
            if choice is None:
                forked = forked or call
                continue
            extended = self._extend(call, choice, text, messages, n, tools, tool_choice, kwargs)
            if extended is None:
                forked = forked or call
                continue
            ids, drift = extended
            reply = choice.reply if choice.reply == keys[n] else keys[n]
            shared = (*call.messages, reply, *keys[n + 1 :])  # share the parent's key objects
            prefix = len(call.prompt_ids) + len(choice.output_ids)
            return PromptPlan(ids, drift, prefix, call.call_id), shared
        ids = self.tok.encode(text)
        if forked is not None:
            return PromptPlan(ids, "forked", 0, forked.call_id), keys
        return PromptPlan(ids, "none", 0, None), keys

    def _extend(
        self,
        call: _Call,
        choice: _Choice,
        text: str,
        messages: list[dict[str, Any]],
        n: int,
        tools: list | None,
        tool_choice: Any,
        kwargs: dict[str, Any],
    ) -> tuple[list[int], str] | None:
        """``(ids, drift)`` continuing ``call``'s sampled ids (``messages[n]`` is its reply), or None when the
        re-render cannot align."""
        reused = call.prompt_ids.tolist() + choice.output_ids.tolist()
        length = call.text_len
        if hash(text[:length]) == call.text_hash and text.startswith(choice.text, length):
            end = length + len(choice.text)  # the sampled text sits where the re-render has it
            if call.clean:
                if self.full_check:
                    whole = self.tok.encode(text)
                    if whole[: len(reused)] == reused:
                        return whole, "clean"
                else:
                    tail = self.tok.encode(text[call.split_at :])
                    head = reused[len(call.prompt_ids) - call.tail_len :]
                    if tail[: len(head)] == head:
                        return reused + tail[len(head) :], "clean"
            return reused + self.tok.encode(text[end:]), "realigned"
        # The reply re-renders differently: continue after the re-rendered parent conversation.
        rendered = self.tok.render(
            messages[: n + 1], tools=tools, tool_choice=tool_choice, add_generation_prompt=False, **kwargs
        )
        trailer = self._assistant_trailer()
        if trailer is None or not text.startswith(rendered) or not rendered.endswith(trailer):
            return self._realign_by_probe(choice, text, messages, n, tools, tool_choice, kwargs, reused)
        end = len(rendered) - len(trailer)
        if choice.stop_text and trailer.startswith(choice.stop_text):
            end += len(choice.stop_text)  # the sampled stop token covers the template's end-of-turn token
        return reused + self.tok.encode(text[end:]), "realigned"

    def _realign_by_probe(
        self,
        choice: _Choice,
        text: str,
        messages: list[dict[str, Any]],
        n: int,
        tools: list | None,
        tool_choice: Any,
        kwargs: dict[str, Any],
        reused: list[int],
    ) -> tuple[list[int], str] | None:
        """For templates that render a turn differently once later messages follow (Qwen3 strips the
        reasoning of turns before the last user message, from this reply and from earlier ones): render
        the request with the reply replaced by a probe; what follows the probe is what follows the reply,
        so it is the new part to append after the sampled ids (which stand in for everything before it).
        None when the probe does not render or the two renders do not agree around it."""
        probe = [*messages[:n], {"role": "assistant", "content": _PROBE}, *messages[n + 1 :]]
        try:
            rendered = self.tok.render(probe, tools=tools, tool_choice=tool_choice, **kwargs)
        except ValueError as e:  # the template refuses the probe (e.g. tool results without a call)
            log.debug("probe render failed, the call forks: %s", e)
            return None
        at = rendered.find(_PROBE)
        if at < 0 or rendered.find(_PROBE, at + 1) >= 0:
            return None
        head, tail = rendered[:at], rendered[at + len(_PROBE) :]
        if len(head) + len(tail) > len(text) or not text.startswith(head) or not text.endswith(tail):
            return None
        if choice.stop_text and tail.startswith(choice.stop_text):
            tail = tail[len(choice.stop_text) :]  # the sampled stop token is the template's end of turn
        return reused + self.tok.encode(tail), "realigned"

    def _assistant_trailer(self) -> str | None:
        """What the template writes after an assistant message's content (ChatML: ``<|im_end|>\\n``);
        None when a probe conversation cannot show it (then replies that re-render differently fork)."""
        if self._trailer is None:
            probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
            try:
                rendered = self.tok.render(probe, add_generation_prompt=False)
            except ValueError as e:
                log.warning("chat template rejects a user/assistant probe, no realignment possible: %s", e)
                rendered = ""
            self._trailer = rendered[rendered.index(_PROBE) + len(_PROBE) :] if _PROBE in rendered else False
        return self._trailer if isinstance(self._trailer, str) else None

    # ---- state

    def _state(self, rollout_id: str) -> _Rollout:
        state = self._rollouts.get(rollout_id)
        if state is not None:
            self._rollouts.move_to_end(rollout_id)
            return state
        state = _Rollout(deque(maxlen=self.max_calls))
        self._rollouts[rollout_id] = state
        while len(self._rollouts) > self.max_rollouts:
            self._rollouts.popitem(last=False)
        if self.loader is not None:
            self.loads += 1
            for record in self.loader(rollout_id):
                self._add(state, record)
        return state

    def _add(self, state: _Rollout, record: CallRecord) -> None:
        if record.operation != "chat" or record.status != "ok" or record.prompt_ids is None:
            return
        if record.call_id in state.call_ids:
            return
        try:
            messages, tools, kwargs = request_args(record.request)
        except (KeyError, ValueError) as e:  # a stored body (e.g. ingested over OTLP) that is no chat request
            log.warning("call %s cannot be a prefix parent: %r", record.call_id, e)
            return
        tool_choice = kwargs.pop("tool_choice")
        ctx = context_key(tools, tool_choice, kwargs)
        pending = next((p for p in state.pending if p.ctx == ctx and p.prompt_ids == record.prompt_ids), None)
        if pending is not None:
            state.pending.remove(pending)
            text, keys, clean = pending.text, pending.keys, pending.clean
        else:
            try:
                text = self.tok.render(messages, tools=tools, tool_choice=tool_choice, **kwargs)
            except ValueError as e:  # e.g. a stored call from before a template change
                log.warning(
                    "call %s cannot be a prefix parent: its messages do not render: %s", record.call_id, e
                )
                return
            keys = tuple(message_key(m) for m in messages)
            clean = self.tok.encode(text) == list(record.prompt_ids)
        split_at = max((i + len(t) for t in self._split_tokens if (i := text.rfind(t)) >= 0), default=0)
        tail_len = len(self.tok.encode(text[split_at:])) if clean else 0
        eos = set(self.tok.eos_token_ids)
        choices = [
            _Choice(
                array("l", ch.output_ids),
                message_key(ch.message),
                bare_key(ch.message),
                self.tok.decode(ch.output_ids),
                self.tok.decode(ch.output_ids[-1:]) if ch.output_ids and ch.output_ids[-1] in eos else None,
            )
            for ch in record.choices
            if ch.output_ids is not None and ch.message is not None
        ]
        state.add(
            _Call(
                record.call_id,
                ctx,
                keys,
                array("l", record.prompt_ids),
                len(text),
                hash(text),
                clean,
                split_at,
                tail_len,
                choices,
            )
        )
