"""Training runs (one model being trained, what the API calls a training client's model) and the order
their requests run in.

Ordering rule: the requests of one run carry ``seq_id`` 1, 2, 3, ... (the ``tinker`` SDK numbers them so)
and run one at a time in that order, whatever order they arrive in; a request without a ``seq_id`` takes
the next free one on arrival. A ``seq_id`` that was already taken means a second client is stepping the
same run: it is refused with 409 before anything runs. A request refused for bad input still uses up its
``seq_id``, so the ones after it are not held up. A gap that is not filled within ``gap_timeout`` seconds
fails the requests waiting behind it."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracegym.trainer.service.futures import UserFault


class SeqConflict(Exception):
    """A ``seq_id`` this run has already taken (answered 409)."""


@dataclass
class Run:
    model_id: str
    base_model: str
    lora_rank: int | None
    group: Any
    """The run's ``WorkerGroup``."""
    model_dir: Path
    facts: dict[str, Any]
    """``vocab_size``, ``max_length`` (``steps.model_facts``)."""
    key: str = field(default_factory=lambda: "tml-run-" + secrets.token_urlsafe(24))
    """The per-run key: it works for this run's requests and its samplers only."""
    next_seq: int = 1
    taken: set[int] = field(default_factory=set)
    turn: asyncio.Condition = field(default_factory=asyncio.Condition)
    sync: Any = None
    """Its weight sync (``DiskWeightSync`` or ``AdapterSync``), made at the first publish."""
    published: list[str] = field(default_factory=list)
    """Weight versions published from this run, oldest first."""
    last_request: float = field(default_factory=time.time)
    """When the run was created or last given a request (``claim``), as ``time.time()``."""

    @property
    def safe_id(self) -> str:
        return self.model_id.replace(":", "_")

    def claim(self, seq_id: int | None) -> int:
        """Take ``seq_id`` (None: the next free one) for a request that arrived; ``SeqConflict`` if taken."""
        if seq_id is None:
            seq_id = max([self.next_seq - 1, *self.taken]) + 1
        if seq_id < self.next_seq or seq_id in self.taken:
            raise SeqConflict(
                f"seq_id {seq_id} of run {self.model_id} was already used: another client is stepping this "
                f"run (requests of one run are numbered 1, 2, 3, ... and run in that order; next expected: "
                f"{max([self.next_seq - 1, *self.taken]) + 1}); use one training client per run")
        self.taken.add(seq_id)
        self.last_request = time.time()
        return seq_id

    @asynccontextmanager
    async def ordered(self, seq_id: int, gap_timeout: float) -> AsyncIterator[None]:
        """Hold the run from ``seq_id``'s turn until the block ends; then the next request's turn."""
        async with self.turn:
            try:
                await asyncio.wait_for(self.turn.wait_for(lambda: self.next_seq == seq_id), gap_timeout)
            except TimeoutError:
                self.taken.discard(seq_id)
                raise UserFault(f"seq_id {seq_id} waited {gap_timeout:.0f} s for seq_id {self.next_seq}, which "
                                "never arrived: send a run's requests with consecutive seq_ids") from None
        try:
            yield
        finally:
            async with self.turn:
                self.taken.discard(seq_id)
                self.next_seq = seq_id + 1
                self.turn.notify_all()
