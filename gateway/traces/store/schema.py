"""Tables of the trace store (SQLAlchemy Core). Times are UNIX seconds (double precision) except span
times, which are OpenTelemetry nanoseconds; token arrays are compact little-endian bytes (see codec.py).

The alembic migration ``0001_initial`` creates exactly these tables; change both together.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets a BIGINT identity.
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

tasks = sa.Table(
    "tasks",
    metadata,
    sa.Column("task_id", sa.String(200), primary_key=True),
    sa.Column("input", sa.JSON, nullable=True),
    sa.Column("split", sa.String(100), nullable=True),
    sa.Column("metadata", sa.JSON, nullable=True),
    sa.Column("created_at", sa.Double, nullable=False),
)

rollouts = sa.Table(
    "rollouts",
    metadata,
    sa.Column("rollout_id", sa.String(200), primary_key=True),
    sa.Column("task_id", sa.String(200), nullable=True),
    sa.Column("group_id", sa.String(200), nullable=True),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False, default=1),
    sa.Column("max_attempts", sa.Integer, nullable=False, default=1),
    sa.Column("input", sa.JSON, nullable=True),
    sa.Column("reward", sa.Double, nullable=True),
    sa.Column("reward_final", sa.Boolean, nullable=False, default=False),
    sa.Column("worker_id", sa.String(200), nullable=True),
    sa.Column("lease_seconds", sa.Double, nullable=True),
    sa.Column("lease_expires_at", sa.Double, nullable=True),
    sa.Column("weight_version", sa.String(200), nullable=True),
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("traceback", sa.Text, nullable=True),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("started_at", sa.Double, nullable=True),
    sa.Column("finished_at", sa.Double, nullable=True),
    sa.Index("ix_rollouts_status_created", "status", "created_at"),
    sa.Index("ix_rollouts_created", "created_at", "rollout_id"),
    sa.Index("ix_rollouts_task", "task_id"),
    sa.Index("ix_rollouts_group", "group_id"),
    sa.Index("ix_rollouts_lease", "status", "lease_expires_at"),
)

spans = sa.Table(
    "spans",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("trace_id", sa.String(32), nullable=False),
    sa.Column("span_id", sa.String(16), nullable=False),
    sa.Column("parent_span_id", sa.String(16), nullable=True),
    sa.Column("rollout_id", sa.String(200), nullable=True),
    sa.Column("call_id", sa.String(200), nullable=True),
    sa.Column("source", sa.String(20), nullable=False),
    sa.Column("name", sa.String(500), nullable=False),
    sa.Column("kind", sa.String(20), nullable=False),
    sa.Column("start_time_ns", sa.BigInteger, nullable=False),
    sa.Column("end_time_ns", sa.BigInteger, nullable=False),
    sa.Column("status", sa.String(10), nullable=False),
    sa.Column("status_message", sa.Text, nullable=True),
    sa.Column("attributes", sa.JSON, nullable=False),
    sa.Column("resource", sa.JSON, nullable=True),
    sa.Column("events", sa.JSON, nullable=True),
    sa.Column("prompt_ids", sa.LargeBinary, nullable=True),
    sa.Column("output_ids", sa.LargeBinary, nullable=True),
    sa.Column("output_logprobs", sa.LargeBinary, nullable=True),
    # Last, so that a read that does not select it (assembly) never touches its bytes in the row.
    sa.Column("request", sa.Text, nullable=True),
    sa.UniqueConstraint("trace_id", "span_id", name="uq_spans_trace_span"),
    sa.Index("ix_spans_rollout_start", "rollout_id", "start_time_ns"),
    sa.Index("ix_spans_call", "call_id"),
)

events = sa.Table(
    "events",
    metadata,
    sa.Column("event_id", BigId, primary_key=True, autoincrement=True),
    sa.Column("rollout_id", sa.String(200), nullable=False),
    sa.Column("kind", sa.String(10), nullable=False),
    sa.Column("name", sa.String(200), nullable=True),
    sa.Column("value", sa.JSON, nullable=True),
    sa.Column("attributes", sa.JSON, nullable=True),
    sa.Column("call_index", sa.Integer, nullable=True),
    sa.Column("idempotency_key", sa.String(200), nullable=False),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.UniqueConstraint("rollout_id", "idempotency_key", name="uq_events_rollout_key"),
    sa.Index("ix_events_rollout", "rollout_id", "event_id"),
)

weight_versions = sa.Table(
    "weight_versions",
    metadata,
    sa.Column("version", sa.String(200), primary_key=True),
    sa.Column("path", sa.Text, nullable=True),
    sa.Column("step", sa.Integer, nullable=True),
    sa.Column("swap_seconds", sa.Double, nullable=True),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Index("ix_weight_versions_created", "created_at"),
)

train_metrics = sa.Table(
    "train_metrics",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("run", sa.String(200), nullable=False),
    sa.Column("step", sa.Integer, nullable=False),
    sa.Column("metrics", sa.JSON, nullable=False),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.UniqueConstraint("run", "step", name="uq_train_metrics_run_step"),
)


# -- value checks derived from the column types ------------------------------------------------------------
# PostgreSQL rejects a string longer than its VARCHAR(n) column, or one holding a NUL character, with a
# DataError that aborts the whole transaction (a batch of spans, say); SQLite stores either. Writers check
# their values first with these, so that one bad value is a clear ValueError (-> 400, or one dropped span)
# on both backends.


def max_length(column: sa.Column) -> int | None:
    """The declared length of a VARCHAR column (None for TEXT and non-string columns)."""
    return getattr(column.type, "length", None)


ID_MAX_LENGTH: int = rollouts.c.rollout_id.type.length
"""The longest id the store keeps: rollout, task, group, worker, call and event ids, weight versions and
idempotency keys are all VARCHAR(200) columns (e.g. for the ``X-Rollout-Id`` / ``X-Task-Id`` headers)."""
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
"""Range of the INTEGER columns (``events.call_index``, ``weight_versions.step``, ``train_metrics.step``)."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Range of the BIGINT columns (span times in nanoseconds)."""


def check_text(name: str, value: object, limit: int | None = None) -> None:
    """ValueError unless ``value`` is None or a string of at most ``limit`` characters without NUL. (The
    valid case is tested first, in one expression: the tracing exporter checks two values per span.)"""
    if value is None or (type(value) is str and (limit is None or len(value) <= limit)
                         and "\x00" not in value):
        return
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    if limit is not None and len(value) > limit:
        raise ValueError(f"{name} is {len(value)} characters long; the store keeps at most {limit}")
    if "\x00" in value:
        raise ValueError(f"{name} must not contain NUL characters")


def check_id_length(name: str, value: object) -> None:
    """``check_text`` against ``ID_MAX_LENGTH``: for ids from headers, paths and bodies before they are
    written (e.g. ``check_id_length("X-Rollout-Id", rid)``)."""
    check_text(name, value, ID_MAX_LENGTH)


def _id_columns_agree() -> None:
    ids = [rollouts.c.rollout_id, rollouts.c.task_id, rollouts.c.group_id, rollouts.c.worker_id,
           rollouts.c.weight_version, tasks.c.task_id, spans.c.rollout_id, spans.c.call_id,
           events.c.rollout_id, events.c.idempotency_key, weight_versions.c.version, train_metrics.c.run]
    if any(max_length(c) != ID_MAX_LENGTH for c in ids):
        raise RuntimeError("the id columns of the schema must all be VARCHAR(ID_MAX_LENGTH)")


_id_columns_agree()
