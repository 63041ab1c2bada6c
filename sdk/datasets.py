"""Dataset forms of the store's rollouts, shared by ``tracegym export`` and ``tracegym import`` (docs/api.md,
"Datasets"):

- ``hf``: a parquet file that ``datasets.load_dataset("parquet", data_files=...)`` opens: one row per
  trajectory sequence with its conversation and tokens (``HF_COLUMNS``). Needs ``pyarrow`` (the
  ``datasets`` extra), imported only here and only for this form.
- ``sft``: one ``{"messages", "tools"?, "reward", "rollout_id", "task_id", "group_id"}`` per rollout (the
  OpenAI chat form, which ``tracegym import`` also takes from any chat JSONL).
- ``dpo``: one ``{"prompt", "chosen", "rejected", "tools"?, "chosen_reward", "rejected_reward",
  "group_id"}`` per group whose highest- and lowest-reward rollouts differ in reward and share their
  prompt messages (TRL's conversational preference form).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

HF_COLUMNS = ("rollout_id", "task_id", "group_id", "run", "sequence", "messages", "tools", "token_ids",
              "loss_mask", "logprobs", "reward", "weight_version", "weight_versions")
"""``messages`` and ``tools`` are JSON text (a conversation's messages differ in shape: tool calls, tool
results); ``logprobs`` holds null where a token was not sampled; ``weight_version`` is the newest version
that sampled a token of the sequence."""

_RUN = re.compile(r"^(?P<run>.+?)-(?:[0-9a-f]{16}-(?:train|eval\d+)|import)-")


def run_of(group_id: str | None) -> str | None:
    """The run (or imported dataset) a group belongs to: ``NAME`` of ``NAME-<16 hex>-train-<n>``,
    ``NAME-<16 hex>-eval<k>-<n>`` or ``NAME-import-<key>``; None for other group ids."""
    m = _RUN.match(group_id or "")
    return m.group("run") if m else None


def _newest(versions: Iterable[Any]) -> str | None:
    vs = [str(v) for v in versions if v is not None]
    if not vs:
        return None
    digits = [v for v in vs if v.isdigit()]
    return max(digits, key=int) if digits else vs[-1]


def hf_rows(trajectory: dict[str, Any], chat: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
    """The ``HF_COLUMNS`` rows of one trajectory (``GET /api/trajectories`` JSON) and its chat record."""
    for k, seq in enumerate(trajectory.get("sequences") or []):
        versions = seq.get("weight_versions") or []
        yield {
            "rollout_id": trajectory["rollout_id"], "task_id": trajectory.get("task_id"),
            "group_id": trajectory.get("group_id"), "run": run_of(trajectory.get("group_id")), "sequence": k,
            "messages": json.dumps(chat["messages"], ensure_ascii=False) if chat else None,
            "tools": json.dumps(chat["tools"], ensure_ascii=False) if chat and chat.get("tools") else None,
            "token_ids": list(seq["token_ids"]), "loss_mask": list(seq["loss_mask"]),
            "logprobs": list(seq["logprobs"]), "reward": trajectory.get("reward"),
            "weight_version": _newest(versions), "weight_versions": [str(v) for v in versions],
        }


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ModuleNotFoundError:
        raise SystemExit("the hf format needs pyarrow: pip install 'tracegym[datasets]'") from None
    return pyarrow


def write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    pa = _pyarrow()
    schema = pa.schema([
        ("rollout_id", pa.string()), ("task_id", pa.string()), ("group_id", pa.string()), ("run", pa.string()),
        ("sequence", pa.int32()), ("messages", pa.string()), ("tools", pa.string()),
        ("token_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())), ("logprobs", pa.list_(pa.float64())),
        ("reward", pa.float64()), ("weight_version", pa.string()), ("weight_versions", pa.list_(pa.string())),
    ])
    table = pa.Table.from_pylist(rows, schema=schema)
    pa.parquet.write_table(table, str(path))


def read_parquet(path: Path) -> list[dict[str, Any]]:
    pa = _pyarrow()
    return pa.parquet.read_table(str(path)).to_pylist()


def dpo_pairs(records: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The ``dpo`` records of chat records (``sft`` form, with ``group_id``): per group, its highest-
    against its lowest-reward rollout where the rewards differ and the prompt messages are the same."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        if rec.get("group_id") and rec.get("reward") is not None:
            groups.setdefault(rec["group_id"], []).append(rec)
    for gid, recs in groups.items():
        best = max(recs, key=lambda r: r["reward"])
        worst = min(recs, key=lambda r: r["reward"])
        if best["reward"] <= worst["reward"] or best["messages"][:-1] != worst["messages"][:-1]:
            continue
        pair = {"prompt": best["messages"][:-1], "chosen": best["messages"][-1:], "rejected": worst["messages"][-1:]}
        if best.get("tools"):
            pair["tools"] = best["tools"]
        yield pair | {"chosen_reward": best["reward"], "rejected_reward": worst["reward"], "group_id": gid}


def token_records(trajectory: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A trajectory line as ``tokens`` import records (one per sequence, with its group)."""
    for seq in trajectory.get("sequences") or []:
        yield {"token_ids": seq["token_ids"], "loss_mask": seq["loss_mask"], "logprobs": seq.get("logprobs"),
               "reward": trajectory.get("reward"), "group_id": trajectory.get("group_id") or trajectory.get("rollout_id")}
