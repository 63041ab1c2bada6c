"""Span rows ready for the database: value tuples in ``COLUMNS`` order, JSON columns already serialized
(orjson, once), token arrays already encoded (``codec``), gathered with the rollout facts the batch implies.

``SpanBatch`` is what ``Store.insert_spans`` writes in one transaction, built from row dicts
(``from_dicts``: OTLP ingest) or from encoded tuples (``add``: the tracing exporter's call rows).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import orjson
import sqlalchemy as sa

from tracegym.gateway.traces.store.schema import INT64_MAX, INT64_MIN, check_text, max_length
from tracegym.gateway.traces.store.schema import rollouts as R
from tracegym.gateway.traces.store.schema import spans as S

COLUMNS: tuple[str, ...] = tuple(c.name for c in S.columns if c.name != "id")
"""Insert order of a row tuple (every ``spans`` column except the generated ``id``)."""
JSON_COLUMNS = frozenset({"attributes", "resource", "events"})
ROLLOUT_POS = COLUMNS.index("rollout_id")
END_POS = COLUMNS.index("end_time_ns")
_REQUIRED = ("trace_id", "span_id", "name", "start_time_ns", "end_time_ns", "attributes")
_DEFAULTS: dict[str, Any] = {"source": "gateway", "kind": "internal", "status": "unset"}
_JSON_OPTS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY
JSON_NULL = "null"
"""How a None in a JSON column is stored (what SQLAlchemy's ``JSON`` type writes for None)."""
_TEXT = tuple((COLUMNS.index(c.name), c.name, max_length(c), c.nullable) for c in S.columns
              if c.name != "id" and isinstance(c.type, sa.String))
"""``(position, column, VARCHAR length or None, nullable)`` of the string columns (see ``check_row``)."""
_BIGINT = tuple(COLUMNS.index(c.name) for c in S.columns
                if c.name != "id" and isinstance(c.type, sa.BigInteger))
_TASK_MAX, _VERSION_MAX = max_length(R.c.task_id), max_length(R.c.weight_version)


def json_text(obj: Any) -> str:
    """The stored text of a JSON column value (the same serializer as the engine's ``json_serializer``).
    orjson's default mode first (cheaper than with ``OPT_NON_STR_KEYS``, and the same text for string
    keys); it raises TypeError for a non-string key or a numpy value, which the options then serialize."""
    try:
        return orjson.dumps(obj).decode()
    except TypeError:
        return orjson.dumps(obj, option=_JSON_OPTS).decode()


def encode_row(row: dict[str, Any], i: int = 0) -> tuple:
    """A row dict (keys: ``spans`` columns) as a value tuple; missing optional columns take defaults."""
    missing = [k for k in _REQUIRED if row.get(k) is None]
    if missing:
        raise ValueError(f"span row {i} lacks {', '.join(missing)}")
    return tuple(
        json_text(row.get(c)) if c in JSON_COLUMNS else row.get(c, _DEFAULTS.get(c)) for c in COLUMNS
    )


def text_checks(columns: Iterable[str]) -> tuple[tuple[int, str, int | None, bool], ...]:
    """The ``check_row`` entries of the named string columns (for ``SpanBatch.add``'s ``text``)."""
    names = set(columns)
    return tuple(t for t in _TEXT if t[1] in names)


def check_row(row: tuple, text: tuple[tuple[int, str, int | None, bool], ...] = _TEXT) -> None:
    """ValueError unless PostgreSQL takes every value of the tuple as SQLite does: strings within their
    column's length and without NUL, no None in a NOT NULL string column, span times within BIGINT. (One
    bad value would otherwise fail the insert of the whole batch on PostgreSQL only.) ``text``: the string
    columns to check (default: all of them)."""
    for pos, name, limit, nullable in text:
        v = row[pos]
        if v is None:
            if not nullable:
                raise ValueError(f"span {name} must not be null")
        elif type(v) is not str or (limit is not None and len(v) > limit) or "\x00" in v:
            check_text(f"span {name}", v, limit)
    for pos in _BIGINT:
        v = row[pos]
        if not isinstance(v, int) or not INT64_MIN <= v <= INT64_MAX:
            raise ValueError(f"span {COLUMNS[pos]} must be an integer within int64, got {v!r}")


class SpanBatch:
    """Rows for one insert transaction, plus per rollout: its task id (first one seen) and the weight
    version of its latest span (by end time)."""

    __slots__ = ("rows", "tasks", "versions")

    def __init__(self) -> None:
        self.rows: list[tuple] = []
        self.tasks: dict[str, str | None] = {}
        self.versions: dict[str, tuple[int, str]] = {}

    @classmethod
    def from_dicts(cls, rows: Iterable[dict[str, Any]]) -> SpanBatch:
        batch = cls()
        for i, r in enumerate(rows):
            attrs = r.get("attributes")
            get = attrs.get if isinstance(attrs, dict) else {}.get
            try:
                batch.add(encode_row(r, i), get("tracegym.task_id"), get("tracegym.weight_version"))
            except ValueError as e:
                raise ValueError(f"span row {i} ({r.get('name')!r}): {e}") from None
        return batch

    def add(self, row: tuple, task_id: str | None, weight_version: str | None,
            text: tuple[tuple[int, str, int | None, bool], ...] = _TEXT) -> None:
        """Append a value tuple (``COLUMNS`` order) with the task id and weight version its span names;
        ValueError (and nothing appended) when a value does not fit its column (``check_row``). ``text``
        names the string columns to check (``text_checks``): all of them unless the caller built the others
        from values known to fit (call rows, see ``call_spans.CALL_ROW_TEXT``)."""
        check_row(row, text)
        rid = row[ROLLOUT_POS]
        if rid is not None:
            check_text("tracegym.task_id", task_id, _TASK_MAX)
            check_text("tracegym.weight_version", weight_version, _VERSION_MAX)
        self.rows.append(row)
        if rid is None:
            return
        tasks = self.tasks
        if tasks.get(rid) is None:
            tasks[rid] = task_id
        if weight_version is not None:
            seen = self.versions.get(rid)
            end = row[END_POS]
            if seen is None or seen[0] <= end:
                self.versions[rid] = (end, weight_version)

    def extend(self, other: SpanBatch) -> None:
        """Append ``other``'s rows (``other`` is not changed): inserting this batch then stores what inserting
        it and then ``other`` would. A rollout keeps the task id of the batch that names it first, and takes
        the weight version of ``other``'s latest span where ``other`` has one (a later batch wins, as a later
        insert does, whatever its spans' end times)."""
        self.rows.extend(other.rows)
        tasks = self.tasks
        for rid, task_id in other.tasks.items():
            tasks.setdefault(rid, task_id)
        self.versions.update(other.versions)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[tuple]:
        return iter(self.rows)
