"""``POST /api/import``: demonstrations, preference pairs and token sequences into the store as completed
rollouts whose calls are ordinary call spans, so they assemble into trajectories like any recorded run
(``tracegym import`` sends files here; docs/api.md, "Import").

Forms (``format``):

- ``chat``: ``{"messages", "tools"?, "reward"?}`` (OpenAI chat form, tool calls included). Every assistant
  message is one call: its prompt is the conversation before it rendered with the served model's chat
  template (generation prompt on), its output the rest of the conversation rendered through it, up to and
  including the template's end-of-turn token. Refused (400, naming the record's line): a tool call of a
  tool the record does not offer, a conversation the template refuses or renders so that an assistant turn
  does not extend its prompt, a record without an assistant message.
- ``dpo``: ``{"prompt": messages, "chosen": message(s), "rejected": message(s), "tools"?}``: a group of two
  rollouts, the chosen one rewarded 1 and the rejected 0 (their prompt tokens are the same by
  construction).
- ``tokens``: ``{"token_ids", "loss_mask", "logprobs"?, "reward"?, "group_id"?}`` (a trajectory's
  sequence, as ``tracegym export --format trajectories`` or ``hf`` wrote it): one call per run of mask-1
  tokens, so the sequence assembles back token for token.

Each record becomes group ``{name}-import-{key}`` (key: the line number, or a ``tokens`` record's own
``group_id``: the groups of an exported run stay groups), which ``sft.runs``/``dpo.runs`` select by
``name``. The imported calls carry no logprobs unless given: GRPO refuses them, SFT and DPO do not need
them. Their spans say ``upstream_kind: import``.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from tracegym.gateway.deps import ServicesDep, StoreDep
from tracegym.gateway.openai_errors import bad_request, error_responses
from tracegym.gateway.proxy.prompt.templating import ChatTokenizer, TemplateRenderError
from tracegym.gateway.traces.call_spans import insert_call_records
from tracegym.types import CallRecord, ChoiceRecord

router = APIRouter(prefix="/api", tags=["import"])

IMPORT_SPLIT = "import"


class ImportBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*$")]
    format: Literal["chat", "dpo", "tokens"]
    records: Annotated[list[dict[str, Any]], Field(max_length=5000)]
    lines: list[int] | None = Field(None, description="Each record's line in its file (for error messages and"
                                    " the group names); default 1, 2, ...")


class RefusedRecord(ValueError):
    pass


def _offered(tools: Any) -> set[str]:
    return {t.get("function", {}).get("name") or t.get("name") for t in tools or [] if isinstance(t, dict)}


def check_tool_calls(messages: list[dict[str, Any]], tools: Any) -> None:
    """Refuse an assistant tool call of a tool the record does not offer."""
    offered = _offered(tools)
    for i, m in enumerate(messages):
        for call in (m.get("tool_calls") or []) if isinstance(m, dict) else []:
            name = (call.get("function") or {}).get("name") if isinstance(call, dict) else None
            if name not in offered:
                what = f"tools {sorted(offered)}" if offered else "no tools"
                raise RefusedRecord(f"messages[{i}] calls tool {name!r}, but the record offers {what}")


def render_calls(tok: ChatTokenizer, messages: list[dict[str, Any]], tools: Any,
                 ) -> list[tuple[int, list[int], list[int]]]:
    """``[(index of the assistant message, prompt ids, output ids)]``, one per assistant message (see the
    module doc)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RefusedRecord("messages must be a list of message objects")
    check_tool_calls(messages, tools)
    eos = set(tok.eos_token_ids)
    calls = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        try:
            prompt = tok.apply(messages[:i], tools=tools or None, add_generation_prompt=True) if i else None
            full = tok.apply(messages[: i + 1], tools=tools or None, add_generation_prompt=False)
        except (TemplateRenderError, ValueError) as e:
            raise RefusedRecord(f"the chat template refuses messages[:{i + 1}]: {e}") from None
        if prompt is None:
            raise RefusedRecord("messages[0] is an assistant message: nothing prompts it")
        if full[: len(prompt)] != prompt:
            raise RefusedRecord(f"the template does not render messages[{i}] as a continuation of its prompt")
        out = full[len(prompt):]
        end = next((k for k, t in enumerate(out) if t in eos), None)
        out = out if end is None else out[: end + 1]
        if not out:
            raise RefusedRecord(f"messages[{i}] renders to no tokens")
        calls.append((i, prompt, out))
    if not calls:
        raise RefusedRecord("no assistant message: nothing to train on")
    return calls


def token_calls(rec: dict[str, Any]) -> list[tuple[list[int], list[int], list[float] | None]]:
    """A ``tokens`` record as ``[(prompt ids, output ids, output logprobs)]``, one per run of mask-1
    tokens (the first token is never one: it has no context)."""
    ids, mask, lps = rec.get("token_ids"), rec.get("loss_mask"), rec.get("logprobs")
    if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
        raise RefusedRecord("token_ids and loss_mask must be lists of one length")
    if lps is not None and (not isinstance(lps, list) or len(lps) != len(ids)):
        raise RefusedRecord("logprobs must be a list as long as token_ids")
    if not all(isinstance(t, int) and t >= 0 for t in ids) or any(m not in (0, 1) for m in mask):
        raise RefusedRecord("token_ids must be non-negative integers and loss_mask 0 or 1")
    if mask and mask[0]:
        raise RefusedRecord("loss_mask[0] must be 0: the first token has no context")
    out, k = [], 0
    while k < len(ids):
        if not mask[k]:
            k += 1
            continue
        end = k
        while end < len(ids) and mask[end]:
            end += 1
        seg_lps = None
        if lps is not None and all(isinstance(x, int | float) for x in lps[k:end]):
            seg_lps = [float(x) for x in lps[k:end]]
        out.append((ids[:k], ids[k:end], seg_lps))
        k = end
    if not out:
        raise RefusedRecord("loss_mask has no 1: nothing to train on")
    return out


def _record(rollout_id: str, task_id: str, model: str, k: int, prompt: list[int], output: list[int],
            logprobs: list[float] | None, request: dict[str, Any], message: dict[str, Any] | None) -> CallRecord:
    t = time.time_ns() + k * 1000  # the calls of a rollout in order
    return CallRecord(
        call_id=f"import-{secrets.token_hex(8)}", rollout_id=rollout_id, operation="chat", model=model,
        upstream_kind="import", request=request,
        choices=[ChoiceRecord(index=0, output_ids=output, output_logprobs=logprobs, finish_reason="stop",
                              message=message)],
        prompt_ids=prompt, task_id=task_id, input_tokens=len(prompt), output_tokens=len(output),
        start_time_ns=t, end_time_ns=t + 1, api="chat",
    )


def _as_messages(value: Any, field: str) -> list[dict[str, Any]]:
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
        raise RefusedRecord(f"{field} must be a message or a non-empty list of messages")
    return value


def plan_record(tok: ChatTokenizer | None, model: str, fmt: str, rec: Any, group_id: str, first: int = 0
                ) -> tuple[dict[str, Any], list[CallRecord]]:
    """One record's group (``ImportsMixin.import_rollouts`` form) and its call records; its rollouts are
    ``{group_id}-{first}``, ``{group_id}-{first + 1}``, ..."""
    if not isinstance(rec, dict):
        raise RefusedRecord("a record must be a JSON object")
    task_id = f"{group_id}-task"
    rollouts: list[tuple[float | None, list[tuple[list[int], list[int], list[float] | None, dict, dict | None]]]] = []
    if fmt == "tokens":
        calls = [(p, o, lp, {"messages": []}, None) for p, o, lp in token_calls(rec)]
        rollouts.append((_reward(rec.get("reward")), calls))
        task_input: Any = {"imported": "tokens"}
    else:
        if tok is None:
            raise RefusedRecord("this gateway has no chat template (no --model): it cannot render messages")
        tools = rec.get("tools")
        if fmt == "chat":
            convs = [(_reward(rec.get("reward")), _as_messages(rec.get("messages"), "messages"))]
        else:
            prompt = _as_messages(rec.get("prompt"), "prompt")
            convs = [(1.0, prompt + _as_messages(rec.get("chosen"), "chosen")),
                     (0.0, prompt + _as_messages(rec.get("rejected"), "rejected"))]
        for reward, messages in convs:
            extra = {"tools": tools} if tools else {}
            calls = [(p, o, None, {"messages": messages[:i], **extra}, messages[i])
                     for i, p, o in render_calls(tok, messages, tools)]
            rollouts.append((reward, calls))
        task_input = {"messages": convs[0][1][:-1]}
    ids = [f"{group_id}-{first + k}" for k in range(len(rollouts))]
    group = {"group_id": group_id, "task_id": task_id, "input": task_input, "split": IMPORT_SPLIT,
             "rollouts": [{"rollout_id": rid, "reward": reward} for rid, (reward, _) in zip(ids, rollouts, strict=True)]}
    records = [_record(rid, task_id, model, k, p, o, lp, req, msg)
               for rid, (_, calls) in zip(ids, rollouts, strict=True) for k, (p, o, lp, req, msg) in enumerate(calls)]
    return group, records


def _reward(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RefusedRecord(f"reward must be a number, got {value!r}")
    return float(value)


def _key(fmt: str, rec: Any, line: int) -> str:
    gid = rec.get("group_id") if fmt == "tokens" and isinstance(rec, dict) else None
    return str(gid) if gid else str(line)


@router.post("/import", status_code=201, responses=error_responses(400))
async def import_records(body: ImportBody, services: ServicesDep, store: StoreDep) -> dict[str, Any]:
    """Render and store the records as completed rollouts; all or nothing (one refused record refuses the
    request, naming its line). Answers ``{"groups": written, "skipped": already there, "rollouts", "calls"}``."""
    tok, model = services.tokenizer, services.served_model

    def work() -> dict[str, Any]:
        if body.lines is not None and len(body.lines) != len(body.records):
            raise bad_request(f"lines has {len(body.lines)} numbers for {len(body.records)} records", param="lines")
        by_group: dict[str, tuple[dict, list[CallRecord]]] = {}
        for k, rec in enumerate(body.records):
            line = body.lines[k] if body.lines is not None else k + 1
            gid = f"{body.name}-import-{_key(body.format, rec, line)}"
            first = len(by_group[gid][0]["rollouts"]) if gid in by_group else 0
            try:
                group, records = plan_record(tok, model, body.format, rec, gid, first)
            except RefusedRecord as e:
                raise bad_request(f"line {line}: {e}", param="records") from None
            if gid in by_group:  # tokens records of one exported group: one group of several rollouts
                by_group[gid][0]["rollouts"] += group["rollouts"]
                by_group[gid][1].extend(records)
            else:
                by_group[gid] = (group, records)
        written = set(store.import_rollouts([g for g, _ in by_group.values()]))
        calls = [r for gid, (_, rs) in by_group.items() if gid in written for r in rs]
        if calls:
            insert_call_records(store, calls)
        return {"groups": len(written), "skipped": len(by_group) - len(written),
                "rollouts": sum(len(g["rollouts"]) for gid, (g, _) in by_group.items() if gid in written),
                "calls": len(calls)}

    return await run_in_threadpool(work)
