"""One LLM call through the gateway: attribution, the upstream request, and the pieces both the
non-stream and the stream paths share (decoding, logprobs, the OpenAI response, the ``CallRecord``)."""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from tracegym.gateway.deps import Services
from tracegym.gateway.errors import OpenAIError, bad_request
from tracegym.gateway.proxy.prompt.reasoning import OPEN as REASONING_OPEN
from tracegym.gateway.proxy.prompt.reasoning import split_reasoning
from tracegym.gateway.proxy.prompt.tools import combine_status, parse_tools
from tracegym.gateway.proxy.upstream.base import GenChoice, GenerateRequest, GenerateResult, TopLogprob
from tracegym.gateway.proxy.validation import ParsedRequest
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
    """The LoRA adapter serving the call (``upstream/lora.py``), set by ``generate_request``."""
    created: int = field(default_factory=lambda: int(time.time()))
    request: GenerateRequest | None = None
    """The upstream request (``generate_request``), whose ``served_by`` names the engine for the record."""


@dataclass(slots=True)
class Prompt:
    """The prompt sent upstream, with its prefix-reuse bookkeeping."""

    ids: list[int] | None
    drift: str = "none"
    prefix_len: int = 0


def new_id() -> str:
    """128 random bits as hex (uuid4's randomness without its per-call ``os.urandom`` syscall)."""
    return f"{random.getrandbits(128):032x}"


def new_context(operation: str, path_rollout: str | None, headers: Any, *, id_prefix: str | None = None
                ) -> CallContext:
    """The call's attribution and id (``id_prefix``: the API's own, e.g. ``resp_``; else by operation)."""
    prefix = id_prefix or ("chatcmpl-" if operation == "chat" else "cmpl-")
    rollout = path_rollout or headers.get("x-rollout-id") or None
    task_id = headers.get("x-task-id") or None
    for name, value in (("rollout_id", rollout), ("X-Task-Id", task_id)):
        if value is not None:
            try:
                check_id_length(name, value)  # the store's id columns: refused here, not at insert time
            except ValueError as e:
                raise bad_request(str(e), name) from e
    return CallContext(
        call_id=prefix + new_id(),
        rollout_id=rollout or f"adhoc-{new_id()}",
        task_id=task_id,
        agent_name=headers.get("x-agent-name") or None,
        adhoc=rollout is None,
    )


async def plan_prompt(svc: Services, parsed: ParsedRequest, ctx: CallContext) -> Prompt:
    """The exact prompt ids (token-native upstreams), reusing the rollout's earlier ids for chat: from the
    prefix cache, or on a miss from the rollout's calls in the store (``parents.py``)."""
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
    if plan.lookup and svc.parents is not None:
        plan = await svc.parents.replan(svc.prefix, ctx.rollout_id, plan)
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
    )
    return req


def trim_stop(text: str, stop_matched: str | None) -> str:
    """SGLang keeps a matched stop string's tokens in output_ids; OpenAI clients never see the string."""
    if stop_matched:
        cut = text.find(stop_matched)
        if cut >= 0:
            return text[:cut]
    return text


def choice_text(svc: Services, ch: GenChoice) -> str:
    if svc.upstream.token_native and svc.tokenizer is not None and ch.output_ids is not None:
        text = svc.tokenizer.decode(ch.output_ids, skip_special_tokens=True)
    else:
        text = ch.text or ""
    return trim_stop(text, ch.stop_matched)


def opens_in_reasoning(svc: Services, prompt: Prompt) -> bool:
    """Whether the prompt ends inside an open ``<think>`` (the template wrote it into the generation prompt),
    so the reply starts with reasoning."""
    if prompt.ids is None or svc.tokenizer is None or not svc.upstream.token_native:
        return False
    if not svc.tokenizer.reasoning:  # a template that never writes <think> cannot open one (no decode per call)
        return False
    return svc.tokenizer.decode(prompt.ids[-4:]).rstrip().endswith(REASONING_OPEN)


def separates_reasoning(svc: Services, parsed: ParsedRequest) -> bool:
    """Whether a chat reply's ``<think>`` block is split off as ``reasoning_content``: when the model's
    template knows reasoning (so a model without it keeps its replies exactly as before) and the request did
    not say ``separate_reasoning: false``."""
    return (parsed.separate_reasoning and svc.tokenizer is not None and svc.tokenizer.reasoning
            and svc.upstream.token_native)


def assistant_message(svc: Services, parsed: ParsedRequest, ch: GenChoice, text: str, *,
                      opens: bool = False) -> tuple[dict[str, Any], str | None]:
    """The chat message of a reply and how its tool-call parse went (``CallRecord.tool_parse``)."""
    if ch.message is not None:  # message-based upstream: its own parse of tool calls (and reasoning)
        msg = {"role": "assistant", "content": ch.message.get("content")}
        if isinstance(ch.message.get("reasoning_content"), str):
            msg["reasoning_content"] = ch.message["reasoning_content"]
        if ch.message.get("tool_calls"):
            msg["tool_calls"] = ch.message["tool_calls"]
        return msg, None
    msg = {"role": "assistant", "content": text}
    if separates_reasoning(svc, parsed):
        reasoning, msg["content"] = split_reasoning(text, opens_in_reasoning=opens)
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
    if not parsed.parse_tools:
        return msg, None
    tp = parse_tools(msg["content"], parsed.tool_names)
    if tp.calls:
        msg["content"], msg["tool_calls"] = tp.content, tp.calls
    return msg, tp.status


def openai_finish_reason(ch: GenChoice, message: dict[str, Any] | None) -> str:
    if message is not None and message.get("tool_calls"):
        return "tool_calls"
    return ch.finish_reason or "stop"


def token_logprob(svc: Services, token_id: int, logprob: float, top: list[TopLogprob] | None) -> dict:
    tok = svc.tokenizer.decode([token_id]) if svc.tokenizer is not None else str(token_id)
    return {
        "token": tok, "logprob": logprob, "bytes": list(tok.encode("utf-8")),
        "top_logprobs": [token_top(svc, t) for t in top or []],
    }


def token_top(svc: Services, t: TopLogprob) -> dict:
    tok = t.text if t.text is not None else (
        svc.tokenizer.decode([t.token_id]) if svc.tokenizer is not None and t.token_id is not None else "")
    return {"token": tok, "logprob": t.logprob, "bytes": list(tok.encode("utf-8"))}


def logprob_entries(svc: Services, ch: GenChoice) -> list[dict] | None:
    """OpenAI chat logprob entries of the choice's tokens (None without ids or logprobs)."""
    if ch.output_ids is None or ch.logprobs is None:
        return None
    tops = ch.top_logprobs or [None] * len(ch.output_ids)
    return [token_logprob(svc, i, lp, t) for i, lp, t in zip(ch.output_ids, ch.logprobs, tops, strict=False)]


def chat_logprobs(svc: Services, ch: GenChoice) -> dict | None:
    entries = logprob_entries(svc, ch)
    return None if entries is None else {"content": entries}


def completion_logprobs_of(entries: list[dict], *, offsets: bool = True) -> dict:
    """The legacy completions ``logprobs`` object of chat logprob entries (a streamed chunk has no
    ``text_offset``)."""
    out = {
        "tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
    }
    if offsets:
        out["text_offset"], pos = [], 0
        for e in entries:
            out["text_offset"].append(pos)
            pos += len(e["token"])
    return out


def completion_logprobs(svc: Services, ch: GenChoice) -> dict | None:
    entries = logprob_entries(svc, ch)
    return None if entries is None else completion_logprobs_of(entries)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def tracegym_field(ctx: CallContext, weight_version: str | None, prompt: Prompt) -> dict[str, Any]:
    return {"rollout_id": ctx.rollout_id, "call_id": ctx.call_id, "weight_version": weight_version,
            "drift": prompt.drift}


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


async def acknowledge(ack: Awaitable[bool] | None) -> None:
    """Wait until the call's span is committed (``finish_call``'s ack; None: nothing to wait for); a span
    the store did not take is a 503, so no call is answered 200 without its span."""
    if ack is not None and not await ack:
        raise OpenAIError(503, NOT_STORED, type="server_error", code="span_not_stored")


def chat_response(
    svc: Services, parsed: ParsedRequest, ctx: CallContext, prompt: Prompt, result: GenerateResult
) -> tuple[dict[str, Any], CallRecord]:
    out_choices, records, statuses = [], [], []
    opens = separates_reasoning(svc, parsed) and opens_in_reasoning(svc, prompt)
    for ch in result.choices:
        msg, status = assistant_message(svc, parsed, ch, choice_text(svc, ch), opens=opens)
        statuses.append(status)
        finish = openai_finish_reason(ch, msg)
        out_choices.append({"index": ch.index, "message": msg, "logprobs": chat_logprobs(svc, ch)
                            if parsed.logprobs else None, "finish_reason": finish})
        records.append(choice_record(ch, finish, msg, result.weight_version))
    return _response(svc, parsed, ctx, prompt, result, out_choices, records, "chat.completion",
                     tool_parse=combine_status(statuses))


def completion_response(
    svc: Services, parsed: ParsedRequest, ctx: CallContext, prompt: Prompt, result: GenerateResult
) -> tuple[dict[str, Any], CallRecord]:
    out_choices, records = [], []
    for ch in result.choices:
        text = choice_text(svc, ch)
        finish = ch.finish_reason or "stop"
        out_choices.append({"index": ch.index, "text": text, "logprobs": completion_logprobs(svc, ch)
                            if parsed.logprobs else None, "finish_reason": finish})
        records.append(choice_record(ch, finish, {"text": text}, result.weight_version))
    return _response(svc, parsed, ctx, prompt, result, out_choices, records, "text_completion")


def _response(
    svc: Services, parsed: ParsedRequest, ctx: CallContext, prompt: Prompt, result: GenerateResult,
    out_choices: list[dict], records: list[ChoiceRecord], obj: str, tool_parse: str | None = None,
) -> tuple[dict[str, Any], CallRecord]:
    ptoks = prompt_token_count(result.prompt_tokens, prompt)
    rec = build_record(svc, parsed, ctx, prompt, records, weight_version=result.weight_version,
                       prompt_tokens=ptoks, retokenized=result.retokenized,
                       upstream_prompt_ids=result.prompt_ids, reported_output_tokens=result.completion_tokens,
                       tool_parse=tool_parse)
    body = {
        "id": ctx.call_id, "object": obj, "created": ctx.created, "model": svc.served_model,
        "choices": out_choices, "usage": usage(ptoks, rec.output_tokens),
        "system_fingerprint": None, "tracegym": tracegym_field(ctx, result.weight_version, prompt),
    }
    if parsed.return_token_ids:  # vLLM's extension, so a gateway can sit behind another token-exactly
        body["prompt_token_ids"] = rec.prompt_ids
        for c, r in zip(out_choices, records, strict=True):
            c["token_ids"] = r.output_ids
    return body, rec
