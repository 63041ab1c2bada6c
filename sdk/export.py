"""``tracegym export``: trajectories or chat transcripts to JSONL, from the gateway's API.

- ``--format trajectories``: the lines of ``GET /api/trajectories`` as they come (``tracegym.types.
  Trajectory`` JSON: token ids, loss mask, logprobs, reward), for RL or token-level SFT.
- ``--format chat`` (or ``sft``): one ``{"messages", "tools"?, "reward", "rollout_id", "task_id",
  "group_id"}`` per rollout, for chat SFT: the request messages of the rollout's last chat call plus the
  reply it got (from ``GET /api/rollouts/{id}/spans``). Rollouts without a successful chat call are
  skipped and counted.
- ``--format dpo``: preference pairs of the rollouts' groups; ``--format hf``: a parquet dataset of the
  trajectories with their conversations (``tracegym.datasets``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from tracegym.client import GatewayClient, GatewayError, GatewayUnreachableError
from tracegym.progress import Progress

REQUEST_ATTR = "tracegym.request"


def _attr_json(value: Any) -> Any:
    """A structured attribute (the store keeps JSON; OTLP-ingested spans may carry a JSON string)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return None
    return value


def _clean(message: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in message.items() if v is not None}


def chat_example(spans: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``{"messages", "tools"?}`` from a rollout's spans (in start order): the last successful chat call's
    request messages followed by its first choice's message; None when there is no such call."""
    for span in reversed(spans):
        request = _attr_json((span.get("attributes") or {}).get(REQUEST_ATTR))
        choices = span.get("choices") or []
        if span.get("status") == "error" or not isinstance(request, dict) or not choices:
            continue
        messages = request.get("messages")
        reply = choices[0].get("message")
        if not isinstance(messages, list) or not isinstance(reply, dict):
            continue
        example: dict[str, Any] = {"messages": [_clean(m) for m in messages] + [_clean(reply)]}
        if request.get("tools"):
            example["tools"] = request["tools"]
        return example
    return None


def iter_chat(
    client: GatewayClient, *, status: str | None, since: str | None, limit: int | None, skipped: list[str],
    ids: list[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """Chat records of the matching rollouts, newest first (or those of ``ids``, in that order, kept
    when they have ``status``); ids without a chat call go to ``skipped``."""
    n = 0
    if ids is not None:
        rollouts: Iterator[dict[str, Any]] = (
            r for r in map(client.get_rollout, ids) if status is None or r.get("status") == status)
    else:
        rollouts = client.iter_rollouts(status=status, since=since)
    for r in rollouts:
        if limit is not None and n >= limit:
            return
        example = chat_example(client.rollout_spans(r["rollout_id"]))
        if example is None:
            skipped.append(r["rollout_id"])
            continue
        n += 1
        yield {
            **example,
            "reward": r.get("reward"),
            "rollout_id": r["rollout_id"],
            "task_id": r.get("task_id"),
            "group_id": r.get("group_id"),
        }


JSONL_FORMATS = ("trajectories", "chat", "sft", "dpo")
FORMATS = (*JSONL_FORMATS, "hf")


def export_hf(client: GatewayClient, path: Path, *, status: str | None, since: str | None, limit: int | None,
              ids: list[str] | None, progress: Progress | None = None) -> tuple[int, int]:
    """The trajectories with their conversations as a parquet dataset (``tracegym.datasets.HF_COLUMNS``);
    returns (rows written, rollouts without a chat call: their rows have no messages). Calls without
    logprobs (imported demonstrations, re-tokenized upstreams) are included, their logprobs null."""
    from tracegym.datasets import hf_rows, write_parquet

    params = {"status": status, "limit": limit, "include_retokenized": "true",
              **({"ids": ",".join(ids)} if ids else {"since": since})}
    rows: list[dict[str, Any]] = []
    no_chat = 0
    for line in client.iter_lines("/api/trajectories", "export trajectories", params):
        traj = json.loads(line)
        chat = chat_example(client.rollout_spans(traj["rollout_id"]))
        no_chat += chat is None
        rows += hf_rows(traj, chat)
        if progress:
            progress.update(f"exported {len(rows)} sequences")
    if not rows:
        raise SystemExit("tracegym export: no trajectory sequence matched: nothing to write")
    write_parquet(rows, path)
    return len(rows), no_chat


def export(
    client: GatewayClient,
    out: TextIO,
    *,
    fmt: str = "trajectories",
    status: str | None = "completed",
    since: str | None = None,
    limit: int | None = None,
    progress: Progress | None = None,
    ids: list[str] | None = None,
) -> tuple[int, int]:
    """Write JSONL to ``out``; returns (lines written, rollouts skipped). ``ids``: only these rollouts
    (``since`` does not apply)."""
    if fmt not in JSONL_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; expected one of {', '.join(JSONL_FORMATS)}")
    written, skipped = 0, []
    if fmt == "trajectories":
        params = {"status": status, "limit": limit, **({"ids": ",".join(ids)} if ids else {"since": since})}
        lines: Iterator[str] = client.iter_lines("/api/trajectories", "export trajectories", params)
    else:
        records: Iterable[dict[str, Any]] = iter_chat(client, status=status, since=since, limit=limit,
                                                      skipped=skipped, ids=ids)
        if fmt == "dpo":
            from tracegym.datasets import dpo_pairs

            records = dpo_pairs(records)
        lines = (json.dumps(rec, ensure_ascii=False) for rec in records)
    for line in lines:
        out.write(line.rstrip("\n") + "\n")
        written += 1
        if progress:
            progress.update(f"exported {written}" + (f" | skipped {len(skipped)}" if skipped else ""))
    return written, len(skipped)


def main(args: argparse.Namespace) -> int:
    """``tracegym export``. The gateway is looked at before any file is opened; the output is written to
    ``OUT.part`` and renamed when complete (a gateway lost half-way leaves the lines written so far there,
    and no ``.part`` file when there were none)."""
    from tracegym.cli_gateway import check_gateway, lost_gateway
    from tracegym.queue_commands import gateway_config

    config = gateway_config(args.gateway)
    check_gateway(config.gateway_url, args.gateway)
    out_path = Path(args.out)
    tmp = out_path.with_name(out_path.name + ".part")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    bar = Progress(sys.stderr, interval=5.0)
    ids = [i for i in (getattr(args, "ids", None) or "").split(",") if i] or None
    # Rollouts named by --ids are exported whatever their status unless --status is given.
    status = args.status if args.status is not None else (None if ids else "completed")
    try:
        if args.format == "hf":
            with GatewayClient(config) as client:
                written, skipped = export_hf(client, tmp, status=status or None, since=args.since,
                                             limit=args.limit, ids=ids, progress=bar)
            summary = f"exported {written} sequences (hf format, parquet) to {out_path}"
            note = f" ({skipped} rollouts without a chat call: no messages)" if skipped else ""
        else:
            with GatewayClient(config) as client, open(tmp, "w", encoding="utf-8") as f:
                written, skipped = export(client, f, fmt=args.format, ids=ids, status=status or None,
                                          since=args.since, limit=args.limit, progress=bar)
            summary = f"exported {written} records ({args.format} format) to {out_path}"
            note = f" ({skipped} rollouts without a chat call skipped)" if skipped else ""
    except GatewayError as e:
        kept = _drop_if_empty(tmp)
        partial = f" (partial output left in {tmp})" if kept else ""
        if isinstance(e, GatewayUnreachableError):
            raise lost_gateway("the export" + partial, config.gateway_url, e, args.gateway) from None
        raise SystemExit(f"tracegym export: {e}{partial}") from None
    except BaseException:
        _drop_if_empty(tmp)
        raise
    tmp.replace(out_path)
    bar.close(summary + note)
    return 0


def _drop_if_empty(path: Path) -> bool:
    """Remove ``path`` if it holds nothing; whether a (non-empty) file is left there."""
    try:
        if path.stat().st_size > 0:
            return True
        path.unlink()
    except FileNotFoundError:
        pass
    return False
