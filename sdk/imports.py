"""``tracegym import FILE --name NAME``: demonstrations, preference pairs and exported datasets into the
gateway's store as completed rollouts (``POST /api/import``, docs/api.md "Datasets"). The gateway renders
chat records with its model's chat template, token-exactly; a record it refuses stops the import with
its line number (records sent before it stay imported, and a re-run skips them: groups are named by
line).

Forms (``--format``): ``chat``/``sft`` (OpenAI chat JSONL, ``{"messages", "tools"?, "reward"?}`` per line),
``dpo`` (``{"prompt", "chosen", "rejected", "tools"?}`` per line), ``trajectories`` (``tracegym export``'s
trajectory lines, imported token for token) and ``hf`` (a parquet file of ``tracegym export --format hf``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tracegym.client import GatewayClient, GatewayError
from tracegym.progress import Progress

FORMATS = ("chat", "sft", "dpo", "trajectories", "hf")
CHUNK = 500
"""Records per request."""


def read_records(path: Path, fmt: str) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """``(line number, wire format, record)`` of the file (the wire formats: chat, dpo, tokens). A line
    that is not a JSON object stops the import with its number."""
    if fmt == "hf":
        from tracegym.datasets import read_parquet

        for k, row in enumerate(read_parquet(path), start=1):
            yield k, "tokens", {key: row.get(key) for key in ("token_ids", "loss_mask", "logprobs", "reward",
                                                              "group_id")}
        return
    from tracegym.datasets import token_records

    wire = {"chat": "chat", "sft": "chat", "dpo": "dpo", "trajectories": "tokens"}[fmt]
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"tracegym import: {path}:{n}: not JSON ({e})") from None
            if not isinstance(rec, dict):
                raise SystemExit(f"tracegym import: {path}:{n}: a record is a JSON object")
            if fmt == "trajectories":
                for sub in token_records(rec):
                    yield n, wire, sub
            else:
                yield n, wire, rec


def import_file(client: GatewayClient, path: Path, *, name: str, fmt: str,
                progress: Progress | None = None) -> dict[str, int]:
    """Send the file's records in chunks of ``CHUNK``; the summed answers."""
    totals = {"groups": 0, "skipped": 0, "rollouts": 0, "calls": 0}
    chunk: list[tuple[int, dict[str, Any]]] = []
    wire = "chat"

    def send() -> None:
        first = chunk[0][0]
        body = {"name": name, "format": wire, "records": [r for _, r in chunk], "lines": [n for n, _ in chunk]}
        got = client.post("/api/import", body, f"import {path.name} from line {first}")
        for k in totals:
            totals[k] += int(got.get(k, 0))
        if progress:
            progress.update(f"imported {totals['rollouts']} rollouts ({totals['skipped']} groups already there)")
        chunk.clear()

    for line, wire_fmt, rec in read_records(path, fmt):
        wire = wire_fmt
        # a full chunk is sent, but never between two records of one group (a group is written once)
        if len(chunk) >= CHUNK and not (wire == "tokens" and rec.get("group_id") == chunk[-1][1].get("group_id")):
            send()
        chunk.append((line, rec))
    if chunk:
        send()
    return totals


def main(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise SystemExit(f"tracegym import: no such file: {path}")
    from tracegym.cli_gateway import check_gateway
    from tracegym.queue_commands import gateway_config

    config = gateway_config(args.gateway)
    check_gateway(config.gateway_url, args.gateway)  # no gateway: two lines in a few seconds, not retries
    bar = Progress(sys.stderr, interval=5.0)
    with GatewayClient(config) as client:
        try:
            got = import_file(client, path, name=args.name, fmt=args.format, progress=bar)
        except GatewayError as e:
            raise SystemExit(f"tracegym import: {path}: {e}") from None
    note = f", {got['skipped']} groups already imported" if got["skipped"] else ""
    bar.close(f"imported {got['rollouts']} rollouts in {got['groups']} groups ({got['calls']} calls) from {path}"
              f" as {args.name}-import-*{note}")
    return 0
