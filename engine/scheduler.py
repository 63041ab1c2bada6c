"""The engine's one model thread: dynamic batching with a shared KV cache, pause/abort, weight swaps.

Batching policy: requests wait in a FIFO queue; at every step boundary (before each decode step) waiting
requests are admitted up to ``max_batch_size``: they are prefilled together (those asking for prompt
logprobs in a forward of their own that keeps the logits they need: ``scoring.py``), their first token
sampled, and their cache rows merged into the running batch, which then decodes one token per row per step.
Finished rows leave at once. So a request arriving mid-batch joins at the next step, not the next batch.
An idle engine gathers a burst first (``_gather``): a step's requests arrive over HTTP one by one, up to a few
ms apart, and the first, prefilled at once, would run a forward of its own while the rest queue behind it.

Control operations (abort, pause, continue, weight update) are commands run by this thread between two
steps, so the model is never modified under a running forward pass. A weight update on an unpaused
server behaves like SGLang's writer lock: requests submitted before it finish first, later ones wait for
the swap; on a paused server it runs at once."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tokenizers import Tokenizer

from tracegym.engine import kv_batch as kvb
from tracegym.engine.precast import LinearCasts
from tracegym.engine.request import ABORTED, ABORTED_WAITING, GenRequest
from tracegym.engine.sampling import sample_rows, top_logprobs
from tracegym.engine.scoring import fill_prompt_logprobs, kept_columns, scoring_plan
from tracegym.engine.weights import apply_state

log = logging.getLogger(__name__)

GATHER_QUIET_S = 0.006
"""An idle engine's wait for a burst's next request (a lone request waits this once)."""
GATHER_MAX_S = 0.03
"""The longest an idle engine gathers a burst, however steadily requests come."""


@dataclass
class EngineStats:
    max_batch_size_seen: int = 0
    requests_served: int = 0
    requests_aborted: int = 0
    prefill_batches: int = 0
    decode_steps: int = 0
    tokens_generated: int = 0
    weight_updates: int = 0


@dataclass
class _PendingSwap:
    state: dict[str, torch.Tensor]
    version: str | None
    future: Future
    barrier: int  # requests with seq < barrier are served with the old weights first
    aborted: int  # requests aborted for this update (abort_all_requests)


class Scheduler:
    def __init__(
        self,
        model: Any,
        tokenizer: Tokenizer,
        *,
        device: torch.device,
        max_batch_size: int,
        weight_version: str,
        autocast_dtype: torch.dtype | None = None,
        gather_quiet_s: float = GATHER_QUIET_S, gather_max_s: float = GATHER_MAX_S,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.autocast_dtype = autocast_dtype
        self.gather_quiet_s, self.gather_max_s = gather_quiet_s, gather_max_s
        # Linear weights cast to the autocast dtype once per load, not at every forward (``precast.py``)
        self.casts = LinearCasts(model, autocast_dtype) if autocast_dtype is not None else None
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.stats = EngineStats()
        self.paused = False
        self.frozen = False  # paused in place: running rows keep their cache but do not step
        self._cv = threading.Condition()
        self._incoming: deque[GenRequest] = deque()
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._stopping = False
        self._closed = False  # the model thread has ended: nothing will serve new requests or commands
        self._seq = itertools.count()
        self._waiting: deque[GenRequest] = deque()
        self._running: list[GenRequest] = []
        self._batch: kvb.KVBatch | None = None
        self._swap: _PendingSwap | None = None
        self.row_hook: Callable[[list[GenRequest]], None] | None = None
        """Called on the model thread with the requests of each forward's rows, in row order (LoRA)."""
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)

    # ---------------------------------------------------------------- called from other threads

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        """The model thread is running (it only ends at ``stop()`` or on an internal error)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Abort everything and end the model thread (which then fails whatever is still queued)."""
        if not self.alive():
            return
        fut = self._command(lambda: self._abort_where(lambda r: True))
        with contextlib.suppress(Exception):
            fut.result(timeout=10)
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    def submit(self, reqs: list[GenRequest]) -> None:
        with self._cv:
            for r in reqs:
                r.seq = next(self._seq)
                self._incoming.append(r)
            self._cv.notify_all()
            closed = self._closed
        if closed:
            self._fail_orphans(RuntimeError("the engine's model thread is not running"))

    def abort(self, rid: str = "", *, abort_all: bool = False, exact: bool = False) -> Future:
        """Abort the requests whose rid starts with ``rid`` (SGLang's prefix rule; equals it with
        ``exact``), or all of them."""

        def match(r: GenRequest) -> bool:
            return abort_all or (bool(rid) and (r.rid == rid if exact else r.rid.startswith(rid)))

        return self._command(lambda: self._abort_where(match))

    def pause(self, mode: str) -> Future:
        return self._command(lambda: self._pause(mode))

    def resume(self) -> Future:
        return self._command(self._resume)

    def update_weights(self, state: dict[str, torch.Tensor], version: str | None, abort_all: bool) -> Future:
        """Resolves with the number of requests that were aborted for it once the new weights serve."""
        fut: Future = Future()

        def run() -> None:
            if self._swap is not None:
                raise RuntimeError("another weight update is in progress")
            aborted = self._abort_where(lambda r: True) if abort_all else 0
            self._swap = _PendingSwap(state, version, fut, barrier=next(self._seq), aborted=aborted)
            self._swap_if_ready()
            if not fut.done():
                log.info(
                    "weight update waits for %d in-flight requests", len(self._running) + len(self._waiting)
                )

        def forward_error(cmd: Future) -> None:
            err = cmd.exception()
            if err is not None and not fut.done():
                fut.set_exception(err)

        self._command(run).add_done_callback(forward_error)
        return fut

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the model thread between forwards (LoRA loads, the weight-version label)."""
        return self._command(fn)

    def busy(self) -> bool:
        """Requests are running or queued (held requests of a paused server do not count)."""
        with self._cv:
            return bool(self._running) or (not self.paused and bool(self._waiting or self._incoming))

    def snapshot(self) -> dict[str, Any]:
        with self._cv:
            return {
                **asdict(self.stats),
                "running_requests": len(self._running),
                "waiting_requests": len(self._waiting) + len(self._incoming),
                "paused": self.paused,
                "max_batch_size": self.max_batch_size,
                "weight_version": self.weight_version,
            }

    def _command(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        with self._cv:
            self._commands.append((fn, fut))
            self._cv.notify_all()
            closed = self._closed
        if closed:
            self._fail_orphans(RuntimeError("the engine's model thread is not running"))
        return fut

    @staticmethod
    def _run_command(fn: Callable[[], Any], fut: Future) -> None:
        try:
            fut.set_result(fn())
        except Exception as e:  # handed to the caller through the future
            fut.set_exception(e)

    # ---------------------------------------------------------------- the model thread

    def _has_work(self) -> bool:
        return (
            self._stopping
            or bool(self._commands or self._incoming)
            or (bool(self._running) and not self.frozen)
            or (not self.paused and bool(self._admissible()))
        )

    def _loop(self) -> None:
        torch.set_num_threads(torch.get_num_threads())  # OpenMP's count is per thread: the process's here too
        err = RuntimeError("the engine stopped")
        try:
            with torch.inference_mode():
                self._serve()
        except BaseException as e:
            # Not expected (steps and swaps handle their own errors); whatever ends this thread must not
            # leave callers waiting for requests or commands nobody will serve.
            log.exception("the engine's model thread died")
            err = RuntimeError(f"the engine's model thread died: {e!r}")
        with self._cv:
            self._closed = True
        self._fail_orphans(err)

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._has_work():
                    self._cv.wait()
                if self._stopping:
                    return
                self._gather()
                commands, self._commands = list(self._commands), deque()
                self._waiting.extend(self._incoming)
                self._incoming.clear()
            for fn, fut in commands:
                self._run_command(fn, fut)
            try:
                self._admit()
                self._step()
            except Exception as e:
                log.exception("engine step failed")
                self._fail_running(e)
            try:
                self._swap_if_ready()
            except Exception as e:  # defensive: ``_swap_if_ready`` fails its swap itself
                log.exception("weight swap failed")
                self._fail_swap(e)

    def _gather(self) -> None:
        """Holding ``_cv``, idle with requests just arrived: wait while more keep arriving (each within
        ``gather_quiet_s`` of the last, ``gather_max_s`` in all, up to a full batch); a command or stop ends it."""
        if self.gather_quiet_s <= 0 or self._running or self.paused or self._commands or not self._incoming:
            return
        deadline, seen = time.monotonic() + self.gather_max_s, -1
        while (not self._stopping and not self._commands and len(self._incoming) != seen  # one arrived in the gap
               and len(self._incoming) + len(self._waiting) < self.max_batch_size
               and (left := deadline - time.monotonic()) > 0):
            seen = len(self._incoming)
            self._cv.wait(min(self.gather_quiet_s, left))

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _admissible(self) -> list[GenRequest]:
        room = self.max_batch_size - len(self._running)
        if room <= 0:
            return []
        barrier = self._swap.barrier if self._swap else None
        return [r for r in itertools.islice(self._waiting, room) if barrier is None or r.seq < barrier]

    def _admit(self) -> None:
        if self.paused:
            return
        new = self._admissible()
        if not new:
            return
        for r in new:
            self._waiting.remove(r)
        zero = [r for r in new if r.params.max_new_tokens == 0]
        for r in zero:
            if not r.scores_prompt:
                r.finish_reason = {"type": "length", "length": 0}
                self._deliver(r)
        if any(r.scores_prompt for r in zero):
            self._score_only([r for r in zero if r.scores_prompt])
        new = [r for r in new if r.params.max_new_tokens > 0]
        if not new:
            return
        try:
            # Neither step touches the running batch, so a failure here fails the new requests only.
            new, batch, logits = self._prefill(new)
            merged = batch if self._batch is None else kvb.merge(self._batch, batch, self.model.config)
        except Exception as e:
            log.exception("prefill of %d requests failed", len(new))
            self._fail(new, e)
            return
        self.stats.prefill_batches += 1
        self._batch = merged
        self._running.extend(new)
        self._advance(new, logits)
        self._retire()

    def _prefill(self, reqs: list[GenRequest]) -> tuple[list[GenRequest], kvb.KVBatch, torch.Tensor]:
        """Prefill ``reqs``, filling in the prompt logprobs of those that ask (``scoring``). Returns the
        requests in the batch's row order, the batch and their next-token logits[B, V]."""
        plain, scored, copies = scoring_plan(reqs)
        groups: list[tuple[list[GenRequest], kvb.KVBatch, torch.Tensor]] = []
        if plain:
            batch, logits = self._forward_prefill(plain, 1)
            groups.append((plain, batch, logits[:, -1, :]))
        if scored:
            batch, logits = self._forward_prefill(scored, kept_columns(scored))
            fill_prompt_logprobs(scored, logits, copies)
            groups.append((scored, batch, logits[:, -1, :].clone()))  # not a view holding every column
            del logits
        if len(groups) == 1:
            return groups[0]
        (a, batch_a, logits_a), (b, batch_b, logits_b) = groups
        return [*a, *b], kvb.merge(batch_a, batch_b, self.model.config), torch.cat([logits_a, logits_b])

    def _score_only(self, reqs: list[GenRequest]) -> None:
        """Requests with ``max_new_tokens`` 0 that ask for prompt logprobs: a prefill for those, then done
        (their cache is dropped at once)."""
        try:
            _, scored, copies = scoring_plan(reqs)
            _, logits = self._forward_prefill(scored, kept_columns(scored))
            fill_prompt_logprobs(scored, logits, copies)
        except Exception as e:
            log.exception("prompt logprobs of %d requests failed", len(reqs))
            self._fail(reqs, e)
            return
        self.stats.prefill_batches += 1
        for r in reqs:
            r.finish_reason = {"type": "length", "length": 0}
            self._deliver(r)

    def _forward_prefill(self, reqs: list[GenRequest], keep: int) -> tuple[kvb.KVBatch, torch.Tensor]:
        """One prefill forward of ``reqs`` (rows in this order) keeping ``keep`` logit columns."""
        if self.row_hook is not None:
            self.row_hook(reqs)
        with self._autocast():
            return kvb.prefill_keep(self.model, [r.input_ids for r in reqs], self.device, keep)

    def _step(self) -> None:
        if not self._running or self.frozen or self._batch is None:
            return
        self.stats.max_batch_size_seen = max(self.stats.max_batch_size_seen, len(self._running))
        if self.row_hook is not None:
            self.row_hook(self._running)
        with self._autocast():
            logits = kvb.decode(self.model, self._batch, [r.output_ids[-1] for r in self._running])
        self.stats.decode_steps += 1
        self._advance(self._running, logits)
        self._retire()

    def _advance(self, reqs: list[GenRequest], logits: torch.Tensor) -> None:
        """Append one sampled token to each running request; the ones that finish are delivered by
        ``_retire``."""
        tokens, lps, matrix = sample_rows(
            logits, [r.params for r in reqs], [r.generator for r in reqs], [r.banned_ids() for r in reqs]
        )
        self.stats.tokens_generated += len(tokens)
        for i, r in enumerate(reqs):
            top = top_logprobs(matrix[i], r.top_logprobs_num) if r.top_logprobs_num else None
            r.append(tokens[i], lps[i], top)
            r.check_finish(self.tokenizer, self.max_positions)
            if not r.finished and r.stream and len(r.output_ids) % r.params.stream_interval == 0:
                self._notify(r, False)

    def _deliver(self, r: GenRequest) -> None:
        if r.finish_reason and r.finish_reason["type"] == "abort":
            self.stats.requests_aborted += 1
        else:
            self.stats.requests_served += 1
        self._notify(r, True)

    @staticmethod
    def _notify(r: GenRequest, final: bool) -> None:
        """Hand an update to the request's owner; a failing callback (e.g. its event loop closed at
        shutdown) is logged and must not take the model thread down with it."""
        try:
            r.on_update(r, final)
        except Exception:
            log.exception("delivering an update of request %s failed", r.rid)

    def _retire(self) -> None:
        """Take the finished requests out of the running batch, then deliver them. In this order, a client
        holding its final response is never still counted as running (``snapshot``, ``busy``): callers that
        wait for their request to run, or for the engine to be idle, rely on it."""
        done = [r for r in self._running if r.finished]
        if not done:
            return
        keep = [i for i, r in enumerate(self._running) if not r.finished]
        self._running = [self._running[i] for i in keep]
        try:
            if keep and self._batch is not None:
                self._batch = kvb.select(self._batch, keep, self.model.config)
            else:
                self._batch = None
        except Exception as e:
            # The kept rows' cache is gone with the batch: they fail; the finished ones keep their result.
            log.exception("dropping %d finished rows from the batch failed", len(done))
            self._fail_running(e)
        for r in done:
            self._deliver(r)

    def _abort_where(self, pred: Callable[[GenRequest], bool]) -> int:
        with self._cv:
            self._waiting.extend(self._incoming)
            self._incoming.clear()
        n = 0
        for r in [r for r in self._running if not r.finished and pred(r)]:
            r.abort(ABORTED)
            n += 1
        self._retire()
        for r in [r for r in self._waiting if pred(r)]:
            self._waiting.remove(r)
            r.abort(ABORTED_WAITING)
            self._deliver(r)
            n += 1
        return n

    def _fail(self, reqs: list[GenRequest], err: Exception) -> None:
        for r in reqs:
            if not r.finished:
                r.finish_reason = {"type": "abort", "message": f"engine error: {err}", "status_code": 500,
                                   "err_type": None}  # SGLang's FINISH_ABORT always has the key
                self._deliver(r)

    def _fail_running(self, err: Exception) -> None:
        running, self._running, self._batch = self._running, [], None
        self._fail(running, err)

    def _fail_orphans(self, err: Exception) -> None:
        """Fail every request, command and pending swap left behind by the model thread (only called once
        it has ended its loop, so nothing else steps these requests)."""
        with self._cv:
            orphans = [*self._running, *self._waiting, *self._incoming]
            self._running, self._batch = [], None
            self._waiting.clear()
            self._incoming.clear()
            commands, self._commands = list(self._commands), deque()
        self._fail(orphans, err)
        self._fail_swap(err)
        for _, fut in commands:
            if not fut.done():
                fut.set_exception(err)

    def _fail_swap(self, err: Exception) -> None:
        with self._cv:
            swap, self._swap = self._swap, None
        if swap is not None and not swap.future.done():
            swap.future.set_exception(err)

    def _pause(self, mode: str) -> int:
        if mode not in ("abort", "in_place"):
            raise ValueError(f"pause mode {mode!r} is not supported by the embedded engine (abort, in_place)")
        aborted = self._abort_where(lambda r: True) if mode == "abort" else 0
        self.paused, self.frozen = True, mode == "in_place"
        return aborted

    def _resume(self) -> None:
        self.paused = self.frozen = False

    def _swap_if_ready(self) -> None:
        s = self._swap
        if s is None:
            return
        earlier = any(r.seq < s.barrier for r in self._waiting)
        if not self.paused and (self._running or earlier):
            return
        try:
            apply_state(self.model, s.state)
            if self.casts is not None:
                self.casts.refresh()
        except Exception as e:
            # Keep serving, with the old weights: ``apply_state`` stages every tensor before copying any.
            log.exception("applying the new weights failed")
            self._fail_swap(e)
            return
        if s.version is not None:
            self.weight_version = s.version
        self.stats.weight_updates += 1
        self._swap = None
        s.future.set_result(s.aborted)
