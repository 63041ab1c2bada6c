"""The rollouts with an errored or drifted call, kept in memory for the inspector's ``has_errors`` and
``has_drift`` filters.

Why not a query per request: both facts live on the spans (a call's status, the ``tracegym.drift``
attribute), about eight per rollout, and a filter that matches few rollouts would read the spans of every
rollout it passes over (most of the store). Spans are never changed once written, so a rollout's flags
only ever gain members: the object reads just the spans stored since its last read (a primary-key range
scan) and keeps two sets of rollout ids, whose size is the number of flagged rollouts. The first read
after the gateway starts scans the whole table once.

SQLite serialises writers, so span ids become visible in id order and the range scan misses nothing.
PostgreSQL may commit a lower id after a higher one (two gateways writing at once); there each read also
rescans the ``PG_RESCAN`` ids below the last maximum (adding a rollout twice is harmless).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from tracegym.gateway.traces.store import ui_reads

log = logging.getLogger("tracegym.gateway")

PG_RESCAN = 20_000
"""PostgreSQL: span ids below the last maximum read again on every refresh (see the module docstring)."""


class FlaggedRollouts:
    def __init__(self, min_interval_s: float = 0.5) -> None:
        self.min_interval_s = min_interval_s
        """Refresh at most this often: a page's several requests share one read."""
        self._lock = threading.Lock()
        self._errors: set[str] = set()
        self._drifted: set[str] = set()
        self._upto = 0
        self._refreshed = -float("inf")
        self._warming = False
        self._warm_lock = threading.Lock()

    def refresh(self, store: Any) -> None:
        """Read the spans stored since the last refresh (thread-safe; at most once per ``min_interval_s``)."""
        with self._lock:
            now = time.monotonic()
            if now - self._refreshed < self.min_interval_s:
                return
            top = ui_reads.max_span_id(store.db)
            lo = self._upto
            if store.dialect == "postgresql":
                lo = max(0, lo - PG_RESCAN)
            if top > lo:
                for rid, error, drifted in ui_reads.flagged_spans(store.db, lo, top):
                    if error:
                        self._errors.add(rid)
                    if drifted:
                        self._drifted.add(rid)
                self._upto = max(self._upto, top)
            self._refreshed = now

    def warm_up(self, store: Any) -> None:
        """Start the first read in a background thread (once), so that the first filter on errors or drift
        does not wait for the whole-table scan: the pages call it when the inspector is opened."""
        with self._warm_lock:  # not self._lock: a refresh holds that one while it reads
            if self._warming:
                return
            self._warming = True
        threading.Thread(target=self._warm, args=(store,), name="inspector-flags", daemon=True).start()

    def _warm(self, store: Any) -> None:
        try:
            self.refresh(store)
        except Exception:  # the filters' own refresh raises it again, to the request that needs it
            log.exception("reading the flagged rollouts in the background failed")

    def errors(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._errors)

    def drifted(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._drifted)
