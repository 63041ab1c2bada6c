"""Initial trace store: tasks, rollouts, spans, events, weight_versions, train_metrics.

Revision ID: 0001_initial
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "tasks",
        sa.Column("task_id", sa.String(200), primary_key=True),
        sa.Column("input", sa.JSON, nullable=True),
        sa.Column("split", sa.String(100), nullable=True),
        sa.Column("metadata", sa.JSON, nullable=True),
        sa.Column("created_at", sa.Double, nullable=False),
    )
    op.create_table(
        "rollouts",
        sa.Column("rollout_id", sa.String(200), primary_key=True),
        sa.Column("task_id", sa.String(200), nullable=True),
        sa.Column("group_id", sa.String(200), nullable=True),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("input", sa.JSON, nullable=True),
        sa.Column("reward", sa.Double, nullable=True),
        sa.Column("reward_final", sa.Boolean, nullable=False),
        sa.Column("worker_id", sa.String(200), nullable=True),
        sa.Column("lease_seconds", sa.Double, nullable=True),
        sa.Column("lease_expires_at", sa.Double, nullable=True),
        sa.Column("weight_version", sa.String(200), nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("traceback", sa.Text, nullable=True),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("started_at", sa.Double, nullable=True),
        sa.Column("finished_at", sa.Double, nullable=True),
    )
    op.create_index("ix_rollouts_status_created", "rollouts", ["status", "created_at"])
    op.create_index("ix_rollouts_created", "rollouts", ["created_at", "rollout_id"])
    op.create_index("ix_rollouts_task", "rollouts", ["task_id"])
    op.create_index("ix_rollouts_group", "rollouts", ["group_id"])
    op.create_index("ix_rollouts_lease", "rollouts", ["status", "lease_expires_at"])
    op.create_table(
        "spans",
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
        sa.UniqueConstraint("trace_id", "span_id", name="uq_spans_trace_span"),
    )
    op.create_index("ix_spans_rollout_start", "spans", ["rollout_id", "start_time_ns"])
    op.create_index("ix_spans_call", "spans", ["call_id"])
    op.create_table(
        "events",
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
    )
    op.create_index("ix_events_rollout", "events", ["rollout_id", "event_id"])
    op.create_table(
        "weight_versions",
        sa.Column("version", sa.String(200), primary_key=True),
        sa.Column("path", sa.Text, nullable=True),
        sa.Column("step", sa.Integer, nullable=True),
        sa.Column("swap_seconds", sa.Double, nullable=True),
        sa.Column("created_at", sa.Double, nullable=False),
    )
    op.create_index("ix_weight_versions_created", "weight_versions", ["created_at"])
    op.create_table(
        "train_metrics",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("run", sa.String(200), nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("metrics", sa.JSON, nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.UniqueConstraint("run", "step", name="uq_train_metrics_run_step"),
    )


def downgrade() -> None:
    for table in ("train_metrics", "weight_versions", "events", "spans", "rollouts", "tasks"):
        op.drop_table(table)
