"""A reply decoded and put in OpenAI's shapes: its text (stop strings trimmed), reasoning split off,
tool calls parsed into the chat message, logprobs, and the Chat Completions and Completions bodies with
the call's record (``chat_response``, ``completion_response``: ``call_path.run_call``'s builders). The
Responses and Messages replies (``reply_parts.py``) start from the same text and chat message."""

from __future__ import annotations

from typing import Any

from tracegym.gateway.deps import Services
from tracegym.gateway.proxy.call_context import (
    CallContext,
    Prompt,
    build_record,
    choice_record,
    prompt_token_count,
)
from tracegym.gateway.proxy.prompt.families import DEFAULT, Family
from tracegym.gateway.proxy.prompt.reasoning import OPEN as REASONING_OPEN
from tracegym.gateway.proxy.prompt.tools import combine_status
from tracegym.gateway.proxy.upstream.base import GenChoice, GenerateResult, PromptLogprobs, TopLogprob
from tracegym.gateway.proxy.validation import ParsedRequest
from tracegym.types import CallRecord, ChoiceRecord


def family_of(svc: Services) -> Family:
    """The model family whose syntax replies are read with (``prompt/families``)."""
    return svc.tokenizer.family if svc.tokenizer is not None else DEFAULT


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
    family = family_of(svc)
    if separates_reasoning(svc, parsed):
        reasoning, msg["content"] = family.split_reasoning(text, opens)
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
    if not parsed.parse_tools and not family.framed_replies:
        return msg, None
    tp = family.parse_tools(msg["content"], parsed.tool_names if parsed.parse_tools else ())
    if tp.calls or family.framed_replies:  # (hermes text without calls stays as it was: "" is not None)
        msg["content"] = tp.content
    if tp.calls:
        msg["tool_calls"] = tp.calls
    return msg, tp.status if parsed.parse_tools else None


def openai_finish_reason(ch: GenChoice, message: dict[str, Any] | None) -> str:
    if message is not None and message.get("tool_calls"):
        return "tool_calls"
    return ch.finish_reason or "stop"


def token_name(svc: Services, token_id: int, as_ids: bool = False) -> str:
    """A token as logprob entries name it: its text, or vLLM's ``token_id:{id}`` (``return_tokens_as_token_ids``)."""
    if as_ids:
        return f"token_id:{token_id}"
    return svc.tokenizer.decode([token_id]) if svc.tokenizer is not None else str(token_id)


def token_logprob(svc: Services, token_id: int, logprob: float, top: list[TopLogprob] | None,
                  as_ids: bool = False) -> dict:
    tok = token_name(svc, token_id, as_ids)
    return {
        "token": tok, "logprob": logprob, "bytes": list(tok.encode("utf-8")),
        "top_logprobs": [token_top(svc, t, as_ids) for t in top or []],
    }


def token_top(svc: Services, t: TopLogprob, as_ids: bool = False) -> dict:
    if as_ids and t.token_id is not None:
        tok = token_name(svc, t.token_id, True)
    else:
        tok = t.text if t.text is not None else (
            svc.tokenizer.decode([t.token_id]) if svc.tokenizer is not None and t.token_id is not None else "")
    return {"token": tok, "logprob": t.logprob, "bytes": list(tok.encode("utf-8"))}


def logprob_entries(svc: Services, ch: GenChoice, as_ids: bool = False) -> list[dict] | None:
    """OpenAI chat logprob entries of the choice's tokens (None without ids or logprobs)."""
    if ch.output_ids is None or ch.logprobs is None:
        return None
    tops = ch.top_logprobs or [None] * len(ch.output_ids)
    return [token_logprob(svc, i, lp, t, as_ids)
            for i, lp, t in zip(ch.output_ids, ch.logprobs, tops, strict=False)]


def chat_logprobs(svc: Services, ch: GenChoice, as_ids: bool = False) -> dict | None:
    entries = logprob_entries(svc, ch, as_ids)
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


def completion_logprobs(svc: Services, ch: GenChoice, as_ids: bool = False) -> dict | None:
    entries = logprob_entries(svc, ch, as_ids)
    return None if entries is None else completion_logprobs_of(entries)


def prompt_logprob_entries(svc: Services, pl: PromptLogprobs, as_ids: bool = False) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else ``{"<id>": {"logprob", "rank",
    "decoded_token"}}`` for the token itself and for each of the top alternatives asked for (``rank`` 1 is the
    most likely). The upstream reports no rank for a prompt token outside those: its ``rank`` is null."""
    out: list[dict | None] = []
    for i, (tid, lp) in enumerate(zip(pl.token_ids, pl.logprobs, strict=True)):
        if lp is None:
            out.append(None)
            continue
        tops = (pl.top[i] if pl.top is not None else None) or []
        ranks = {t.token_id: r for r, t in enumerate(tops, 1)}
        entry = {str(tid): {"logprob": lp, "rank": ranks.get(tid), "decoded_token": token_name(svc, tid, as_ids)}}
        for r, t in enumerate(tops, 1):
            if t.token_id is not None and t.token_id != tid:
                entry[str(t.token_id)] = {"logprob": t.logprob, "rank": r,
                                          "decoded_token": token_name(svc, t.token_id, as_ids)}
        out.append(entry)
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def tracegym_field(ctx: CallContext, weight_version: str | None, prompt: Prompt) -> dict[str, Any]:
    return {"rollout_id": ctx.rollout_id, "call_id": ctx.call_id, "weight_version": weight_version,
            "drift": prompt.drift}


def chat_response(
    svc: Services, parsed: ParsedRequest, ctx: CallContext, prompt: Prompt, result: GenerateResult
) -> tuple[dict[str, Any], CallRecord]:
    out_choices, records, statuses = [], [], []
    opens = separates_reasoning(svc, parsed) and opens_in_reasoning(svc, prompt)
    for ch in result.choices:
        msg, status = assistant_message(svc, parsed, ch, choice_text(svc, ch), opens=opens)
        statuses.append(status)
        finish = openai_finish_reason(ch, msg)
        out_choices.append({"index": ch.index, "message": msg, "logprobs": chat_logprobs(svc, ch, parsed.tokens_as_ids)
                            if parsed.logprobs else None, "finish_reason": finish})
        records.append(choice_record(ch, finish, msg, result.weight_version))
    return _response(svc, parsed, ctx, prompt, result, out_choices, records, "chat.completion",
                     tool_parse=combine_status(statuses))


def completion_response(
    svc: Services, parsed: ParsedRequest, ctx: CallContext, prompt: Prompt, result: GenerateResult
) -> tuple[dict[str, Any], CallRecord]:
    out_choices, records = [], []
    prompt_lps = None
    if parsed.prompt_logprobs is not None and result.prompt_logprobs is not None:
        prompt_lps = prompt_logprob_entries(svc, result.prompt_logprobs, parsed.tokens_as_ids)
    for ch in result.choices:
        text = choice_text(svc, ch)
        finish = ch.finish_reason or "stop"
        out_choices.append({"index": ch.index, "text": text, "logprobs": completion_logprobs(
            svc, ch, parsed.tokens_as_ids) if parsed.logprobs else None, "finish_reason": finish})
        if parsed.prompt_logprobs is not None:
            out_choices[-1]["prompt_logprobs"] = prompt_lps
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
