"""Weight swaps on a fleet of engines (``fleet.UpstreamFleet``), all or none. ``swap.SwapCoordinator``
runs the same sequences as for one engine; the fleet hands it ``FleetGate`` (every engine's gate at
once) and ``FleetControl.post`` (each step on every engine of the rotation, in parallel):

- the engines a swap pauses are the ones it loads and continues (an engine that comes back during the
  swap joins only after it);
- disk: ``/update_weights_from_disk`` on every engine; when any refuses or cannot be reached, those
  that loaded the new version load the previous one again (the fleet's last weights directory, or the
  engines' own model as started) under the previous version, and the swap is reported failed naming the
  engines that refused. An engine whose rollback fails, or for which no previous directory is known
  (the previous version came by broadcast), leaves the rotation: no engine serves a version the fleet
  does not. An engine that was away during a swap is loaded with the fleet's weights before it rejoins;
- distributed: one process group holds every engine (``/init_weights_update_group`` gives engine ``i``
  ranks from ``rank_offset + i * (world_size - rank_offset) / N``: the trainer's world size counts all
  engines' ranks); each bucket is received by every engine in parallel, as the trainer's one broadcast
  reaches them all. Inside ``/begin_weight_update`` … ``/end_weight_update`` the fleet's version moves
  only when every engine ended the session well. When a bucket failed on any engine, the session ends
  all or none: an engine that stages a session's buckets (it says ``staged_weight_updates: true`` in
  ``/model_info``, as the embedded engine does) gets ``{"discard": true}`` and keeps its weights
  untouched; one that loads buckets as they come (SGLang) ends the session and loads its previous
  weights from disk, as after a refused disk load. When no directory holds them (the previous version
  came by broadcast too) it stays in the rotation holding the buckets it loaded, and the answer says so:
  taking it out would leave nothing for the trainer's next push to reach. An engine that applied its
  session while another failed to is rolled back as after a refused disk load.
  After a distributed swap no directory holds the fleet's weights, so an engine that missed it cannot
  rejoin until the next disk swap (``GET /api/upstreams`` says so)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tracegym.gateway.openai_errors import OpenAIError

if TYPE_CHECKING:
    from tracegym.gateway.proxy.upstream.fleet import Engine, UpstreamFleet
    from tracegym.gateway.proxy.upstream.swap import SwapGate

log = logging.getLogger("tracegym.gateway")

LOAD = "/update_weights_from_disk"


class FleetGate:
    """``swap.SwapGate``'s coordinator side over every engine's gate (each adapter reads its own to
    continue the calls a pause cut short)."""

    def __init__(self, gates: list[SwapGate]) -> None:
        self.gates = gates
        self.generation = 0
        self.swapping = False

    def begin(self) -> None:
        self.generation += 1
        self.swapping = True
        for g in self.gates:
            g.begin()

    def end(self) -> None:
        self.swapping = False
        for g in self.gates:
            g.end()


Result = tuple[int, dict[str, Any]]


def _ok(status: int, body: dict[str, Any]) -> bool:
    return status < 400 and body.get("success") is not False


def _message(status: int, body: dict[str, Any]) -> str:
    msg = body.get("message") or body.get("error_message")  # SGLang's LoRA routes say error_message
    if msg is None and isinstance(body.get("error"), dict):
        msg = body["error"].get("message")
    return str(msg) if msg else f"HTTP {status}"


class FleetControl:
    def __init__(self, fleet: UpstreamFleet) -> None:
        self.fleet = fleet
        self.targets: list[Engine] | None = None
        """The engines the running swap paused (None between swaps)."""
        self.original = True
        """The engines serve the weights they started with (no swap has succeeded yet)."""
        self.session: _Session | None = None
        """The distributed update between ``/begin_weight_update`` and ``/end_weight_update``."""

    async def post(self, path: str, body: dict[str, Any]) -> Result:
        if path == "/pause_generation":
            self.targets = [e for e in self.fleet.engines if e.healthy]
        engines = self.targets if self.targets is not None else [e for e in self.fleet.engines if e.healthy]
        if path == "/continue_generation":
            self.targets = None
        if not engines:
            return 503, {"success": False, "message": "no upstream engine is available"}
        if path == LOAD:
            return await self._load(engines, body)
        if path == "/end_weight_update":
            return await self._end(engines, body)
        if path == "/init_weights_update_group":
            bodies = _group_bodies(body, len(engines))
            if bodies is None:
                return 400, {"success": False, "message": f"world_size {body.get('world_size')} minus rank_offset "
                             f"{body.get('rank_offset')} does not split evenly over {len(engines)} engines"}
        else:
            bodies = [body] * len(engines)
        results = await self._each(engines, path, bodies)
        if path == "/begin_weight_update":
            self.session = _Session() if all(_ok(s, b) for _, s, b in results) else None
        elif path == "/update_weights_from_distributed":
            self._received(engines, results, body.get("weight_version"))
        return _merge(path, results)

    def _received(self, engines: list[Engine], results: list[tuple[Engine, int, dict[str, Any]]],
                  version: Any) -> None:
        """A bucket on every engine: inside a session the version waits for its end; outside one (a
        server without sessions) each bucket is loaded on receipt, so the last one moves the version."""
        ok = all(_ok(s, b) for _, s, b in results)
        if self.session is not None:
            self.session.failed = self.session.failed or not ok
            if version is not None:
                self.session.version = str(version)
        elif ok and version is not None:
            self._moved(engines, str(version), None)

    async def _end(self, engines: list[Engine], body: dict[str, Any]) -> Result:
        """``/end_weight_update`` on every engine, all or none (the module's docstring)."""
        session, self.session = self.session, None
        failed = bool(body.get("discard")) or (session is not None and session.failed)
        if not failed:
            results = await self._each(engines, "/end_weight_update", [body] * len(engines))
            bad = [e for e, s, b in results if not _ok(s, b)]
            if not bad:
                if session is not None and session.version is not None:
                    self._moved(engines, session.version, None)
                return _merge("/end_weight_update", results)
            applied = [e for e, s, b in results if _ok(s, b)]
            rolled = await self._roll_back(applied)
            status, answer = _merge("/end_weight_update", results)
            return status, {**answer, "message": answer["message"] + rolled}
        plain = {k: v for k, v in body.items() if k != "discard"}
        results = await self._each(engines, "/end_weight_update",
                                   [{**plain, "discard": True} if e.staged else plain for e in engines])
        kept = [e.url for e, s, b in results if e.staged and _ok(s, b)]
        loaded = [e for e, s, b in results if e.healthy and not (e.staged and _ok(s, b))]
        stuck = [e.url for e in loaded if self._previous(e) is None]
        rolled = await self._roll_back([e for e in loaded if self._previous(e) is not None])
        notes = ([f"nothing applied on {kept} (staged, discarded)"] if kept else []) + ([rolled[2:]] if rolled else [])
        if stuck:  # taking them out would leave no engine to push the next update to
            notes.append(f"{stuck} keep the buckets they loaded, under version {self.fleet.weight_version} (no "
                         "directory holds the previous weights): push again")
        return 200, {"success": True, "engines": _per_engine(results), "message": "; ".join(notes)}

    async def _each(self, engines: list[Engine], path: str, bodies: list[dict[str, Any]]
                    ) -> list[tuple[Engine, int, dict[str, Any]]]:
        """``path`` on each engine in parallel; an unreachable engine counts as a refusal (502/504) and
        leaves the rotation."""
        results = await asyncio.gather(*(e.adapter.post_control(path, b)  # type: ignore[attr-defined]
                                         for e, b in zip(engines, bodies, strict=True)), return_exceptions=True)
        out = []
        for e, r in zip(engines, results, strict=True):
            if isinstance(r, OpenAIError):
                e.healthy, e.error = False, f"{path}: {r.message}"
                out.append((e, r.status, {"success": False, "message": r.message}))
            elif isinstance(r, BaseException):
                raise r
            else:
                out.append((e, *r))
        return out

    async def _load(self, engines: list[Engine], body: dict[str, Any]) -> Result:
        results = await self._each(engines, LOAD, [body] * len(engines))
        failed = [(e, s, b) for e, s, b in results if not _ok(s, b)]
        if not failed:
            self._moved(engines, body.get("weight_version"), str(body["model_path"]))
            return _merge(LOAD, results)
        loaded = [e for e, s, b in results if _ok(s, b)]
        refused = "; ".join(f"{e.url}: {_message(s, b)}" for e, s, b in failed)
        rolled = await self._roll_back(loaded)
        return 400, {"success": False, "message": f"not loaded on {len(failed)} of {len(engines)} engines "
                     f"({refused}){rolled}", "engines": _per_engine(results)}

    def _moved(self, engines: list[Engine], version: Any, path: str | None) -> None:
        fleet = self.fleet
        if version is not None:
            fleet.weight_version = str(version)
            for e in engines:
                e.weight_version = str(version)
        fleet.weights_path = path
        self.original = False

    def _previous(self, e: Engine) -> str | None:
        """The directory of the fleet's current weights (before the failed swap) for ``e``."""
        if self.fleet.weights_path is not None:
            return self.fleet.weights_path
        return e.model_path if self.original else None

    async def _roll_back(self, loaded: list[Engine]) -> str:
        if not loaded:
            return ""
        version = self.fleet.weight_version
        outcomes = await asyncio.gather(*(self._load_previous(e, version) for e in loaded))
        back = [e.url for e, ok in zip(loaded, outcomes, strict=True) if ok]
        out = [e.url for e, ok in zip(loaded, outcomes, strict=True) if not ok]
        log.warning("fleet weight swap failed: rolled %s back to version %s%s", back, version,
                    f"; out of the rotation: {out}" if out else "")
        return (f"; rolled back to version {version} on {back}" if back else "") + \
            (f"; out of the rotation (no rollback): {out}" if out else "")

    async def _load_previous(self, e: Engine, version: str | None) -> bool:
        path = self._previous(e)
        if path is None:
            e.healthy, e.error = False, "holds a version the fleet does not (a failed swap, nothing to roll back to)"
            return False
        body: dict[str, Any] = {"model_path": path}
        if version is not None:
            body["weight_version"] = version
        [(_, status, answer)] = await self._each([e], LOAD, [body])
        if not _ok(status, answer):
            e.healthy, e.error = False, f"rollback to {path} failed: {_message(status, answer)}"
            return False
        e.weight_version = version
        return True

    async def catch_up(self, e: Engine) -> bool:
        """Load the fleet's weights into ``e``, back after missing a swap; False (``e`` stays out) when
        no directory holds them or the load fails, or when a swap started meanwhile."""
        fleet, gate = self.fleet, self.fleet.gate
        if self.original:  # no swap yet: it serves the weights it started with, as the others do
            return True
        path = fleet.weights_path
        if path is None:
            e.error = (f"at weight version {e.weight_version}, the fleet at {fleet.weight_version}; no "
                       "directory holds the fleet's weights (a distributed swap): restart it or swap again")
            return False
        generation = gate.generation if gate is not None else 0
        body = {"model_path": path, "weight_version": fleet.weight_version}
        [(_, status, answer)] = await self._each([e], LOAD, [body])
        if not _ok(status, answer):
            e.healthy, e.error = False, f"catching up with {path} failed: {_message(status, answer)}"
            return False
        if gate is not None and gate.generation != generation:
            return False  # a swap ran meanwhile: the next check catches up again
        e.weight_version = fleet.weight_version
        log.info("upstream %s caught up with the fleet's weights (%s, version %s)", e.url, path,
                 fleet.weight_version)
        return True


@dataclass
class _Session:
    version: str | None = None
    """The version the session's last bucket carries."""
    failed: bool = False
    """A bucket failed on some engine."""


def _group_bodies(body: dict[str, Any], n: int) -> list[dict[str, Any]] | None:
    offset = int(body.get("rank_offset", 1))
    ranks = int(body["world_size"]) - offset
    if ranks < n or ranks % n:
        return None
    per = ranks // n
    return [{**body, "rank_offset": offset + i * per} for i in range(n)]


def _per_engine(results: list[tuple[Engine, int, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    return {e.url: {"success": _ok(s, b), "message": _message(s, b)} for e, s, b in results}


def _merge(path: str, results: list[tuple[Engine, int, dict[str, Any]]]) -> Result:
    """One answer for the fleet: the first engine's when all succeeded, else the worst status with
    every refusal named."""
    bad = [(e, s, b) for e, s, b in results if not _ok(s, b)]
    if not bad:
        return results[0][1], {**results[0][2], "engines": len(results)}
    status = max(s for _, s, _ in bad) if any(s >= 400 for _, s, _ in bad) else 400
    return status, {"success": False, "message": f"{path} failed on " + "; ".join(
        f"{e.url}: {_message(s, b)}" for e, s, b in bad), "engines": _per_engine(results)}
