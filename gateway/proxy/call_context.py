"""One inference call apart from the shape of its reply, the same for every API: its attribution and id
(``CallContext``), its prompt ids with prefix reuse (``Prompt``, ``plan_prompt``), its upstream request,
and its ``CallRecord`` (``build_record``), recorded by ``finish_call`` and waited for by ``acknowledge``.
``call_path.run_call`` runs these steps over HTTP; ``openai_replies.py`` and ``reply_parts.py`` shape the
reply."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from tracegym.gateway.deps import Services
from tracegym.gateway.openai_errors import OpenAIError, bad_request
from tracegym.gateway.proxy.upstream.base import GenChoice, GenerateRequest
from tracegym.gateway.proxy.validation import ParsedRequest
from tracegym.gateway.traces.store.keys import ordered_hex
from tracegym.gateway.traces.store.schema import check_id_length
from tracegym.types import CallRecord, ChoiceRecord, WeightVersionSpan


@dataclass(slots=True)
class CallContext:
    call_id: str
    rollout_id: str
    task_id: str | None
    agent_name: str | None
    adhoc: bool
    start_ns: int = field(default_factory=time.time_ns)
    lora_adapter: str | None = None
    """The LoRA adapter serving the call (``upstream/adapter_table.py``), set by ``generate_request``."""
    created: int = field(default_factory=lambda: int(time.time()))
    request: GenerateRequest | None = None
    """The upstream request (``generate_request``), whose ``served_by`` names the engine for the record."""


@dataclass(slots=True)
class Prompt:
    """The prompt sent upstream, with its prefix-reuse bookkeeping."""

    ids: list[int] | None
    drift: str = "none"
    prefix_len: int = 0


def new_context(operation: str, path_rollout: str | None, headers: Any, *, id_prefix: str | None = None
                ) -> CallContext:
    """The call's attribution and id (``id_prefix``: the API's own, e.g. ``resp_``; else by operation)."""
    prefix = id_prefix or ("chatcmpl-" if operation == "chat" else "cmpl-")
    given = _attribution(headers)
    rollout = path_rollout or given.get(b"x-rollout-id") or None
    task_id = given.get(b"x-task-id") or None
    for name, value in (("rollout_id", rollout), ("X-Task-Id", task_id)):
        if value is not None:
            try:
                check_id_length(name, value)  # the store's id columns: refused here, not at insert time
            except ValueError as e:
                raise bad_request(str(e), name) from e
    return CallContext(
        call_id=prefix + ordered_hex(),  # time-ordered: a new call's rows go to the ends of the store's indexes
        rollout_id=rollout or f"adhoc-{ordered_hex()}",
        task_id=task_id,
        agent_name=given.get(b"x-agent-name") or None,
        adhoc=rollout is None,
    )


_ATTRIBUTION = frozenset({b"x-rollout-id", b"x-task-id", b"x-agent-name"})


def _attribution(headers: Any) -> dict[bytes, str]:
    """The attribution headers present, read in one pass over a Starlette ``Headers``' raw list (its
    ``get`` scans the list once per name) or looked up in any other mapping."""
    raw = getattr(headers, "raw", None)
    if raw is None:
        return {k: v for k in _ATTRIBUTION if (v := headers.get(k.decode()))}
    found: dict[bytes, str] = {}
    for k, v in raw:
        if k in _ATTRIBUTION and k not in found:  # the first of repeated headers, as ``Headers.get``
            found[k] = v.decode("latin-1")
    return found


async def plan_prompt(svc: Services, parsed: ParsedRequest, ctx: CallContext) -> Prompt:
    """The exact prompt ids (token-native upstreams), reusing the rollout's earlier ids for chat: from the
    prefix cache, or on a miss from the rollout's calls in the store (``prefix_lookup.py``)."""
    if parsed.operation == "text_completion":
        if isinstance(parsed.prompt, list):
            return Prompt(ids=list(parsed.prompt))
        return Prompt(ids=svc.tokenizer.encode(parsed.prompt) if svc.tokenizer else None)
    if not svc.upstream.token_native:
        return Prompt(ids=None)
    assert svc.prefix is not None and svc.tokenizer is not None
    if ctx.adhoc:  # a fresh rollout id minted for this call: no history to reuse, no store lookup
        return Prompt(ids=svc.tokenizer.apply(parsed.messages, parsed.tools, **template_kwargs(parsed)))
    plan = svc.prefix.plan_chat(ctx.rollout_id, parsed.messages, parsed.tools, **template_kwargs(parsed))
    if plan.lookup and svc.prefix_lookup is not None:
        plan = await svc.prefix_lookup.replan(svc.prefix, ctx.rollout_id, plan)
    return Prompt(ids=plan.prompt_ids, drift=plan.drift, prefix_len=plan.prefix_len)


def template_kwargs(parsed: ParsedRequest) -> dict[str, Any]:
    kw = dict(parsed.template_kwargs or {})
    if parsed.tool_choice is not None:
        kw["tool_choice"] = parsed.tool_choice
    return kw


def generate_request(svc: Services, parsed: ParsedRequest, ctx: CallContext, prompt: Prompt) -> GenerateRequest:
    sampling = parsed.sampling
    if svc.upstream.token_native and svc.tokenizer is not None:
        sampling.stop_token_ids = list(svc.tokenizer.eos_token_ids)
    table = getattr(svc.upstream, "adapters", None)
    ctx.lora_adapter = None if table is None else table.adapter_for(ctx.agent_name)
    req = ctx.request = GenerateRequest(
        rid=ctx.call_id, operation=parsed.operation, sampling=sampling,
        input_ids=prompt.ids if svc.upstream.token_native else None,
        body=None if svc.upstream.token_native else parsed.body,
        logprobs=parsed.logprobs, top_logprobs=parsed.top_logprobs, adapter=ctx.lora_adapter,
        route_key=None if ctx.adhoc else ctx.rollout_id,
        prompt_logprobs=parsed.prompt_logprobs,  # only token-native upstreams get here with it
    )
    return req


def prompt_token_count(result_prompt_tokens: int, prompt: Prompt) -> int:
    return result_prompt_tokens or (len(prompt.ids) if prompt.ids is not None else 0)


def build_record(
    svc: Services, parsed: ParsedRequest, ctx: CallContext, prompt: Prompt, choices: list[ChoiceRecord], *,
    weight_version: str | None, prompt_tokens: int, retokenized: bool, first_token_ns: int | None = None,
    error: str | None = None, upstream_prompt_ids: list[int] | None = None, reported_output_tokens: int = 0,
    tool_parse: str | None = None,
) -> CallRecord:
    """The call's record; ``output_tokens`` counts the choices' ids, else what the upstream reported."""
    ids = upstream_prompt_ids if upstream_prompt_ids is not None else prompt.ids
    request = parsed.body if parsed.source is None else {**parsed.body, "tracegym_source": parsed.source}
    return CallRecord(
        call_id=ctx.call_id, rollout_id=ctx.rollout_id, operation=parsed.operation, model=svc.served_model,
        upstream_kind=svc.upstream.kind, request=request, choices=choices, prompt_ids=ids,
        task_id=ctx.task_id, agent_name=ctx.agent_name, weight_version=weight_version, drift=prompt.drift,
        prefix_len=prompt.prefix_len, retokenized=retokenized, input_tokens=prompt_tokens,
        output_tokens=sum(len(c.output_ids or ()) for c in choices) or reported_output_tokens, start_time_ns=ctx.start_ns,
        end_time_ns=time.time_ns(), first_token_time_ns=first_token_ns,
        status="error" if error else "ok", error=error, api=parsed.api, tool_parse=tool_parse,
        upstream=ctx.request.served_by if ctx.request is not None else None,
        lora_adapter=ctx.lora_adapter,
    )


def choice_record(ch: GenChoice, finish: str | None, message: dict | None, weight_version: str | None) -> ChoiceRecord:
    n = len(ch.output_ids or ())
    if ch.weight_versions:  # continued across a weight swap (upstream/sglang.py)
        spans = list(ch.weight_versions)
    else:
        spans = [WeightVersionSpan(weight_version, 0, n)] if weight_version is not None and n else []
    return ChoiceRecord(index=ch.index, output_ids=ch.output_ids, output_logprobs=ch.logprobs,
                        finish_reason=finish, message=message, weight_versions=spans)


def finish_call(svc: Services, ctx: CallContext, rec: CallRecord) -> Awaitable[bool] | None:
    """Record the call and, for a successful token-exact chat call in a named rollout, remember it for
    prefix reuse (an ad-hoc rollout id was minted for this one call: nothing will extend it). With
    ``durability="commit"`` returns what the answer must wait for (``acknowledge``): True once the span is
    committed, False if it was lost."""
    ack = None
    if svc.recorder is not None:
        if svc.settings.durability == "commit":
            ack = svc.recorder.record_durably(rec)
        else:
            svc.recorder.record(rec)
    if (rec.status == "ok" and rec.operation == "chat" and svc.prefix is not None and not ctx.adhoc
            and not rec.retokenized and rec.prompt_ids is not None):
        svc.prefix.remember(rec.rollout_id, rec)
    return ack


NOT_STORED = "the trace store did not commit this call's span, so it is not answered as a success"
NOT_COMMITTED = ("the trace store did not commit this call's span within {:g} s (--commit-timeout), so it is not "
                 "answered as a success")


async def settled(ack: Awaitable[bool] | None, timeout_s: float) -> bool | None:
    """Wait for ``finish_call``'s ack (None: nothing to wait for), at most ``timeout_s``: True once
    the span is committed, False when the store did not take it, None when the wait timed out (the span
    may still be committed later)."""
    if ack is None:
        return True
    fut: asyncio.Future = ack  # type: ignore[assignment]
    if fut.done():
        return fut.result()
    timer = fut.get_loop().call_later(timeout_s, _expire, fut)
    try:
        return await fut
    finally:
        timer.cancel()


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():  # the writer settles it later: its result is no longer looked at
        fut.set_result(None)


async def acknowledge(ack: Awaitable[bool] | None, timeout_s: float) -> None:
    """Wait until the call's span is committed (``settled``); a span the store did not take, or did not
    commit within ``timeout_s`` (``GatewaySettings.commit_timeout_s``), is a 503, so no call is answered
    200 without its span."""
    ok = await settled(ack, timeout_s)
    if ok is None:
        raise OpenAIError(503, NOT_COMMITTED.format(timeout_s), type="server_error", code="span_not_stored")
    if not ok:
        raise OpenAIError(503, NOT_STORED, type="server_error", code="span_not_stored")
