"""Loud attribution failures: a rollout rewarded or finished with no LLM call attributed to it.

Such a rollout trains on nothing, and nothing else says so: its calls went out through an HTTP client
tracegym does not instrument, or to a base_url other than the gateway, or from a thread started
outside the scope, and the gateway recorded them under ad-hoc rollouts. So each rollout scope carries
a ``CallTally`` (shared with the nested scopes of the same rollout) that the instrumented clients bump
for every LLM call they send to the gateway for that rollout (``tracegym.instrument.stamp``).

When a reward is sent, or the scope that opened the rollout ends normally, with the tally at zero:

- the gateway is asked whether the rollout has calls anyway (``GET /api/rollouts/{id}/spans``): the
  tally cannot see calls attributed another way (a rollout-scoped base_url through a client tracegym
  does not patch, an ad-hoc rollout reopened with ``tg.rollout(rollout_id=...)`` to reward it). The
  gateway stores spans in the background, a few milliseconds after it answered the call, so an empty
  answer is asked again a few times (``SPAN_LAG_WAITS``, about a second) before it counts;
- if it has none, a warning names the likely cause (WARNING once per process, INFO after that), and a
  rollout that exists on the gateway is flagged with the event ``tracegym.no_calls`` (its attributes
  say when and why), which ``GET /api/rollouts/{id}`` lists under ``events``.

A user scope that sent nothing at all to the gateway (no reward, no event, no request) is not asked
about: the rollout does not exist there and is not created just to be flagged; the warning is logged.

The check runs in a thread of its own (``check_calls_later``), so neither ``tg.reward`` nor the scope's
end waits for it and a misconfigured agent is not slowed down; the thread is not a daemon, so a script
that ends right after its reward still gets its warning and flag (Python waits for it at exit, a second
or so). Each request is one try with a short timeout, and the check never raises: a missing flag must
not fail the agent. A reward sent before the rollout's calls is checked then, and so may be flagged
although calls follow.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from tracegym.client import GatewayClient, GatewayError, RetryPolicy, SDKConfig

if TYPE_CHECKING:
    from tracegym.context import RolloutScope

log = logging.getLogger("tracegym.attribution")

NO_CALLS_EVENT = "tracegym.no_calls"
CHECK_TIMEOUT = 5.0
"""Seconds the check waits for each answer of the gateway (one try each: the flag is best effort)."""
SPAN_LAG_WAITS = (0.1, 0.3, 0.6)
"""Waits before asking again for spans the gateway may not have stored yet."""
When = Literal["reward", "scope_end"]

# A lock acquired once and never released: the atomic "first time in this process" of the warning.
# Process-wide by contract ("warned about once"), like the install lock in tracegym.instrument.
_FIRST_WARNING = threading.Lock()


class CallTally:
    """What the instrumented clients saw inside one rollout's scopes (thread-safe)."""

    __slots__ = ("_checked", "_lock", "calls", "elsewhere", "touched")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = 0
        """LLM calls sent to the gateway for this rollout."""
        self.touched = False
        """Any request reached the gateway for this rollout (a call, a reward, an event, /v1/models)."""
        self.elsewhere: set[str] = set()
        """Origins (``scheme://host:port``) of LLM calls sent to other hosts."""
        self._checked = False

    def call(self, *, mine: bool) -> None:
        with self._lock:
            self.touched = True
            self.calls += mine

    def touch(self) -> None:
        self.touched = True

    def call_elsewhere(self, origin: str) -> None:
        with self._lock:
            self.elsewhere.add(origin)

    def hosts_elsewhere(self) -> list[str]:
        """``elsewhere``, sorted (a copy: clients of the scope may still be adding to it)."""
        with self._lock:
            return sorted(self.elsewhere)

    def due(self) -> bool:
        """No call seen and not checked yet (a cheap pre-test; ``claim`` decides)."""
        return self.calls == 0 and not self._checked

    def claim(self) -> bool:
        """Take the one check of this rollout's scopes (False if there were calls or it was taken)."""
        with self._lock:
            if self.calls or self._checked:
                return False
            self._checked = True
            return True

    def unclaim(self) -> None:
        """The check could not reach the gateway: let a later trigger try again."""
        with self._lock:
            self._checked = False


def _quick(config: SDKConfig) -> SDKConfig:
    return replace(config, timeout=min(config.timeout, CHECK_TIMEOUT), retry=RetryPolicy(attempts=1))


def diagnose(scope: RolloutScope, when: When) -> tuple[str, str]:
    """``(cause, message)``: the likely cause in a phrase, and the whole warning."""
    from tracegym.instrument import instrumented

    gw, rid = scope.config.gateway_url, scope.rollout_id
    what = "was rewarded" if when == "reward" else "ended"
    libs = ", ".join(instrumented()) or "none imported yet"
    if hosts := scope.tally.hosts_elsewhere():
        cause = f"its LLM calls went to {', '.join(hosts)}, not to the gateway at {gw}"
        advice = f"point the client's base_url at the gateway ({gw}/v1)"
        fate = "Those calls are not recorded at all."
    else:
        cause = (
            "no instrumented HTTP client sent an LLM call to the gateway inside the scope: the agent "
            "likely sends through a client tracegym does not instrument (it instruments httpx, httpx2, "
            f"requests and aiohttp; patched here: {libs}), or to a base_url other than {gw}"
        )
        advice = (
            "check the client's base_url; start threads with contextvars.copy_context().run (a bare "
            "threading.Thread does not inherit the scope)"
        )
        fate = "Calls that reached the gateway without the rollout's headers are under ad-hoc rollouts."
    message = (
        f"tracegym: rollout {rid} {what} with no LLM call attributed to it, so it has nothing to train "
        f"on: {cause}. Fix: {advice}; a rollout-scoped base_url ({gw}/rollouts/{rid}/v1) attributes the "
        f"calls of any client. {fate}"
    )
    return cause, message


def _warn(scope: RolloutScope, when: When) -> str:
    """Log the warning (the whole of it the first time in the process, a line at INFO after); returns
    the cause."""
    cause, message = diagnose(scope, when)
    if _FIRST_WARNING.acquire(blocking=False):
        log.warning("%s (Warned once per process; later cases are logged at INFO.)", message)
    else:
        log.info("tracegym: rollout %s has no LLM call attributed to it: %s", scope.rollout_id, cause)
    return cause


def _flag_body(scope: RolloutScope, when: When, cause: str) -> dict[str, Any]:
    from tracegym.instrument import instrumented

    attributes = {
        "when": when,
        "cause": cause,
        "gateway": scope.config.gateway_url,
        "instrumented": instrumented(),
        "calls_elsewhere": scope.tally.hosts_elsewhere(),
    }
    # a fixed idempotency key: one flag per rollout, however many scopes or processes check it
    return {"name": NO_CALLS_EVENT, "attributes": attributes, "idempotency_key": NO_CALLS_EVENT}


def _recorded_calls_now(client: GatewayClient, rollout_id: str) -> int | None:
    try:
        return len(client.rollout_spans(rollout_id))
    except GatewayError as e:
        if e.status == 404:
            return None
        raise
    except (ValueError, KeyError, TypeError) as e:  # not JSON, or not the gateway's JSON
        raise GatewayError(f"unexpected answer from {client.config.gateway_url}: {e!r}") from e


def _recorded_calls(client: GatewayClient, rollout_id: str) -> int | None:
    """How many spans the gateway holds for the rollout, after waiting out its recording lag when it has
    none; None if it does not know the rollout. Raises GatewayError when the gateway cannot tell
    (unreachable, an error, an answer that is not its own)."""
    recorded = _recorded_calls_now(client, rollout_id)
    for wait in SPAN_LAG_WAITS:
        if recorded:
            break
        time.sleep(wait)
        recorded = _recorded_calls_now(client, rollout_id)
    return recorded


def check_calls(scope: RolloutScope, when: When, *, queued: bool = False) -> bool:
    """The check of the module docstring, now (blocking: about a second when it finds nothing).
    ``queued``: the rollout came from the gateway's queue (the runner), so it exists there. Returns True
    when the rollout was found to have no call (and was warned about). Never raises."""
    return scope.tally.claim() and _check(scope, when, queued)


def check_calls_later(scope: RolloutScope, when: When, *, queued: bool = False) -> None:
    """``check_calls`` in a (non-daemon) thread, started only when a check is due; returns at once."""
    if scope.tally.due() and scope.tally.claim():
        name = f"tracegym-check-{scope.rollout_id}"
        threading.Thread(target=_check, args=(scope, when, queued), name=name).start()


def _check(scope: RolloutScope, when: When, queued: bool) -> bool:
    """``check_calls`` once this rollout's check is claimed."""
    tally = scope.tally
    if when == "scope_end" and not (queued or tally.touched):
        _warn(scope, when)
        return True
    rid = scope.rollout_id
    with GatewayClient(_quick(scope.config)) as client:
        try:
            recorded = _recorded_calls(client, rid)
        except GatewayError as e:
            tally.unclaim()
            log.info("tracegym: could not check that rollout %s has calls: %s", rid, e)
            return False
        if recorded:
            return False  # attributed another way: a rollout-scoped path, a reopened ad-hoc rollout
        cause = _warn(scope, when)
        if recorded is not None:  # the rollout exists (it is not created just to carry the flag)
            try:
                client.add_event(rid, "events", _flag_body(scope, when, cause))
            except GatewayError as e:
                log.warning("tracegym: could not flag rollout %s with %s: %s", rid, NO_CALLS_EVENT, e)
    return True
