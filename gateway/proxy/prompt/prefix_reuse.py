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

The earlier calls are the ones this process served (memory), or on a miss the rollout's calls another
gateway recorded in the shared store (``PromptPlan.lookup``, ``PrefixCache.replan``, ``proxy/prefix_lookup.py``).

Cost: the drift check does not re-tokenize the history. A parent whose own prompt matched its
re-render stores where its text was last split by a special token; the check tokenizes only from
there (the last turn plus the new messages), which equals tokenizing the whole because the tokenizer
splits on special tokens first (``full_check=True`` tokenizes the whole instead, for tokenizers where
that does not hold, which is detected for Metaspace ``prepend_scheme="first"``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracegym.arrays import as_token_ids
from tracegym.gateway.proxy.prompt.message_keys import (
    MsgKey,
    bare_key,
    context_key,
    message_key,
    request_args,
)
from tracegym.gateway.proxy.prompt.templating import ChatTokenizer
from tracegym.types import CallRecord

log = logging.getLogger(__name__)

_PROBE = "\x00tracegym-probe\x00"
_MAX_STORED = 2
"""Stored calls ``replan`` adds at most (the deepest parents; one is enough unless its reply was edited).
Each costs a render and an encode of its conversation."""
_MAX_ABSENT = 256
"""Assistant turns per rollout known not to be in the store (the set starts over beyond it)."""


@dataclass(slots=True)
class _Request:
    """What ``plan_chat`` computed of a request, kept so ``PrefixCache.replan`` can plan it again."""

    ctx: str
    text: str
    keys: tuple[MsgKey, ...]
    messages: list[dict[str, Any]]
    tools: list | None
    tool_choice: Any
    kwargs: dict[str, Any]
    covered: int = 0  # leading messages the plan accounts for (a parent's messages and its reply)
    pending: _Pending | None = None


@dataclass
class PromptPlan:
    prompt_ids: list[int]
    drift: str  # "none" | "clean" | "realigned" | "forked" (tracegym.types.Drift)
    prefix_len: int  # leading ids reused from the parent call
    parent_call_id: str | None
    prompt_text: str = ""  # the full re-render of the request's messages
    lookup: bool = False
    """The request holds assistant turns after the part this plan reuses that no call in memory explains:
    a call recorded elsewhere (another gateway on the same store, or this one before a restart) may be its
    parent. ``PrefixCache.replan`` plans again with the rollout's stored calls."""
    request: _Request | None = field(default=None, repr=False, compare=False)


# ---------------------------------------------------------------------------------------------- storage


@dataclass(slots=True)
class _Choice:
    output_ids: np.ndarray  # int64 (tracegym.arrays): a remembered call's ids take no Python int each
    reply: MsgKey
    bare: MsgKey | None  # the reply without its reasoning (None: it has none)
    text: str  # the output ids decoded
    stop_text: str | None  # text of the final token when it is a stop token
    bare_text: str | None  # ``text`` after its reasoning block (None: it has none)
    written: tuple[str, str] | None  # how the template writes it back, and its end token (Family.written_back)

    def matches(self, key: MsgKey) -> bool:
        return self.reply == key or self.bare == key


@dataclass(slots=True)
class _Call:
    call_id: str
    ctx: str
    messages: tuple[MsgKey, ...]
    prompt_ids: np.ndarray  # as _Choice.output_ids
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
    absent: set[MsgKey] = field(default_factory=set)
    """Assistant turns a store lookup found no call for (the agent wrote them): not looked up again."""

    def add(self, call: _Call) -> None:
        if len(self.calls) == self.calls.maxlen:
            self.call_ids.discard(self.calls[0].call_id)
        self.calls.append(call)
        self.call_ids.add(call.call_id)


# ------------------------------------------------------------------------------------------------ cache


class PrefixCache:
    """Per-rollout memory of recent chat calls, bounded (LRU on rollouts, last N calls per rollout).

    Owned by the app's lifespan; called from the asyncio loop only. Callers: ``plan =
    cache.plan_request(rid, body)`` (or ``plan_chat``) before the upstream call, then
    ``cache.remember(rid, record)`` with ``record.prompt_ids == plan.prompt_ids`` after it succeeded.

    A miss: the memory is per process, so a call that extends a call another gateway served (several
    gateways on one store, no sticky routing), or this one before a restart or an eviction, finds no parent
    here, or an older one. Its messages then hold an assistant turn after the part the plan reuses that
    no call in memory explains: ``plan.lookup`` says so, and ``cache.replan(rid, plan, records)`` with the
    rollout's stored calls (``proxy/prefix_lookup.py`` reads them, off the event loop) adds the ones the request
    extends and plans again, exactly as if they had been remembered here. A turn the store does not
    explain either (the agent wrote it) is not looked up again.
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        max_rollouts: int = 10_000,
        max_calls_per_rollout: int = 32,
        full_check: bool = False,
    ) -> None:
        if max_rollouts < 1 or max_calls_per_rollout < 1:
            raise ValueError("max_rollouts and max_calls_per_rollout must be >= 1")
        self.tok = tokenizer
        self.max_rollouts = max_rollouts
        self.max_calls = max_calls_per_rollout
        self.full_check = full_check or not tokenizer.segmented
        self._split_tokens = list(tokenizer.template_split_tokens)
        self._rollouts: OrderedDict[str, _Rollout] = OrderedDict()
        self._trailer: str | bool | None = None  # None: not probed yet; False: unknown
        self._probe_first = False  # a reply that re-renders differently was last realigned by the probe

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
        req = _Request(ctx, text, keys, messages, tools, tool_choice, template_kwargs)
        return self._planned(self._state(rollout_id), req)

    def replan(self, rollout_id: str, plan: PromptPlan, records: Iterable[CallRecord]) -> PromptPlan:
        """``plan`` (``plan.lookup``) again after adding ``records`` (the rollout's stored calls, in start
        order) that its request extends and that this cache lacks: the deepest few, as ``remember`` would
        have kept them. The assistant turns still unexplained are not looked up again."""
        req = plan.request
        if req is None:
            raise ValueError("replan takes a plan made by plan_chat")
        state = self._state(rollout_id)
        if self._add_stored(state, req.keys, records):
            plan = self._planned(state, req)
        state.absent.update(k for k in req.keys[req.covered :] if k[0] == "assistant")
        if len(state.absent) > _MAX_ABSENT:
            state.absent.clear()
        plan.lookup = False
        return plan

    def remember(self, rollout_id: str, record: CallRecord) -> None:
        """Keep a successful chat call as a possible parent (other calls are ignored)."""
        self._add(self._state(rollout_id), record)

    # ---- planning

    def _planned(self, state: _Rollout, req: _Request) -> PromptPlan:
        """The plan of ``req`` from ``state``, its pending entry (for ``remember``) added or updated."""
        plan, keys, req.covered = self._plan(
            state, req.ctx, req.text, req.keys, req.messages, req.tools, req.tool_choice, req.kwargs
        )
        plan.prompt_text, plan.request = req.text, req
        for k in req.keys[req.covered :]:  # the new messages (one or two on a hit)
            if k[0] == "assistant" and k not in state.absent:
                plan.lookup = True
                break
        clean = plan.drift != "realigned"
        pending = req.pending
        if pending is not None and any(p is pending for p in state.pending):  # planned again
            pending.prompt_ids, pending.keys, pending.clean = plan.prompt_ids, keys, clean
        else:
            req.pending = _Pending(plan.prompt_ids, req.ctx, req.text, keys, clean)
            state.pending.append(req.pending)
        return plan

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
    ) -> tuple[PromptPlan, tuple[MsgKey, ...], int]:
        """The plan, the keys to keep for it (sharing the parent's), and how many leading messages it
        accounts for (the parent's and its reply; all of them for a retry; 0 when rendered whole)."""
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
                    ids = call.prompt_ids.tolist()
                    return PromptPlan(
                        ids, "clean" if call.clean else "realigned", len(ids), call.call_id
                    ), keys, n
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
            return PromptPlan(ids, drift, prefix, call.call_id), shared, n + 1
        ids = self.tok.encode(text)
        if forked is not None:
            return PromptPlan(ids, "forked", 0, forked.call_id), keys, 0
        return PromptPlan(ids, "none", 0, None), keys, 0

    def _extend(self, call: _Call, choice: _Choice, text: str, messages: list[dict[str, Any]], n: int,
                tools: list | None, tool_choice: Any, kwargs: dict[str, Any]) -> tuple[list[int], str] | None:
        """``(ids, drift)`` continuing ``call``'s sampled ids (``messages[n]`` is its reply), or None when the
        re-render cannot align."""
        reused = call.prompt_ids.tolist() + choice.output_ids.tolist()
        length = call.text_len
        same_head = hash(text[:length]) == call.text_hash
        if same_head and choice.bare_text is not None and not text.startswith(choice.text, length) \
                and text.startswith(choice.bare_text, length):
            # the template drops the reply's reasoning once later turns follow (Qwen3) and renders the rest
            # as sampled, its end of turn included: what follows it is the new part (as a probe finds)
            return reused + self.tok.encode(text[length + len(choice.bare_text):]), "realigned"
        if same_head and text.startswith(choice.text, length):
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
        if same_head and choice.written is not None:
            # the family knows how the template writes this reply back (harmony: a final answer without its
            # analysis, <|end|> for <|return|>): found where the reply was, what follows is the new part
            written, end_token = choice.written
            at = length + len(written)
            if text.startswith(written, length) and text.startswith(end_token, at):
                if choice.stop_text and text.startswith(choice.stop_text, at):
                    at += len(choice.stop_text)  # the sampled stop token is the template's end of turn
                return reused + self.tok.encode(text[at:]), "realigned"
        # The reply re-renders differently: continue after the re-rendered parent conversation, or after a
        # probe standing for the reply. Where both apply they find the same new part (tested on every
        # family's corpus); whichever worked last is tried first, as a family's template makes one of them
        # work nearly always (Qwen3 and harmony rewrite the reply once more turns follow: the probe).
        if self._probe_first:
            probed = self._realign_by_probe(choice, text, messages, n, tools, tool_choice, kwargs, reused)
            if probed is not None:
                return probed
        rendered = self.tok.render(
            messages[: n + 1], tools=tools, tool_choice=tool_choice, add_generation_prompt=False, **kwargs
        )
        trailer = self._assistant_trailer()
        if trailer is None or not text.startswith(rendered) or not rendered.endswith(trailer):
            probed = None
            if not self._probe_first:
                probed = self._realign_by_probe(choice, text, messages, n, tools, tool_choice, kwargs, reused)
                self._probe_first = probed is not None
            if probed is None and text.startswith(rendered):
                # the probe cannot stand for this reply (a template whose later turns depend on it being a
                # call: DeepSeek V3's first-call flag, harmony's tool-result names), but the parent
                # conversation re-renders as the head of this one: what follows it is the new part
                return reused + self.tok.encode(text[len(rendered):]), "realigned"
            return probed
        self._probe_first = False
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

    def _choice(self, output_ids: list[int], message: dict[str, Any], eos: set[int]) -> _Choice:
        text = self.tok.decode(output_ids)
        family = self.tok.family
        reasoning, rest = family.split_reasoning(text, False)
        return _Choice(
            as_token_ids(output_ids), message_key(message), bare_key(message), text,
            self.tok.decode(output_ids[-1:]) if output_ids and output_ids[-1] in eos else None,
            rest if reasoning is not None and rest != text else None,
            family.written_back(text) if family.written_back is not None else None,
        )

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
        return state

    def _add_stored(self, state: _Rollout, keys: tuple[MsgKey, ...], records: Iterable[CallRecord]) -> bool:
        """Add the deepest few of ``records`` this cache lacks whose messages ``keys`` start with (the
        parents a request with ``keys`` may extend or retry), then order the rollout's calls by depth, so
        planning meets the deepest parent first (store order, by start time, comes from several clocks).
        Whether any was added."""
        candidates: list[tuple[int, CallRecord, list]] = []
        for rec in records:
            if rec.call_id in state.call_ids or rec.operation != "chat" or rec.status != "ok":
                continue
            messages = rec.request.get("messages")
            if isinstance(messages, list) and 0 < len(messages) <= len(keys):
                candidates.append((len(messages), rec, messages))
        candidates.sort(key=lambda c: c[0], reverse=True)  # the deepest first
        added = 0
        for n, rec, messages in candidates:
            try:  # from the last message back: another branch's call differs there soonest
                same = all(message_key(messages[i]) == keys[i] for i in range(n - 1, -1, -1))
            except (AttributeError, TypeError, ValueError) as e:  # a stored body that is no chat request
                log.warning("stored call %s cannot be a prefix parent: %r", rec.call_id, e)
                continue
            if same and self._add(state, rec):
                added += 1
                if added == _MAX_STORED:
                    break
        if added:
            state.calls = deque(sorted(state.calls, key=lambda c: len(c.messages)), maxlen=self.max_calls)
            state.call_ids = {c.call_id for c in state.calls}
        return added > 0

    def _add(self, state: _Rollout, record: CallRecord) -> bool:
        """Keep ``record`` as a possible parent; whether it was added."""
        if record.operation != "chat" or record.status != "ok" or record.prompt_ids is None:
            return False
        if record.call_id in state.call_ids:
            return False
        try:
            messages, tools, kwargs = request_args(record.request)
        except (KeyError, ValueError) as e:  # a stored body (e.g. ingested over OTLP) that is no chat request
            log.warning("call %s cannot be a prefix parent: %r", record.call_id, e)
            return False
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
                return False
            keys = tuple(message_key(m) for m in messages)
            clean = self.tok.encode(text) == list(record.prompt_ids)
        split_at = max((i + len(t) for t in self._split_tokens if (i := text.rfind(t)) >= 0), default=0)
        tail_len = len(self.tok.encode(text[split_at:])) if clean else 0
        eos = set(self.tok.eos_token_ids)
        choices = [self._choice(ch.output_ids, ch.message, eos) for ch in record.choices
                   if ch.output_ids is not None and ch.message is not None]
        state.add(_Call(record.call_id, ctx, keys, as_token_ids(record.prompt_ids), len(text), hash(text), clean,
                        split_at, tail_len, choices))
        return True
