"""The rollout scope (``tg.rollout``) and what attaches to it (``tg.reward``, ``tg.emit``).

The current scope lives in a ``contextvars.ContextVar``: asyncio tasks, ``asyncio.to_thread`` and
``contextvars.copy_context().run`` see the scope they were started in; a bare ``threading.Thread``
starts with no scope (open one inside it, or start it through ``copy_context().run``).

A rollout rewarded, or whose scope ends, with no LLM call attributed to it is checked, warned about
and flagged (``tracegym.attribution``); that never fails the agent.
"""

from __future__ import annotations

import functools
import inspect
import math
import uuid
from collections.abc import Callable
from contextvars import ContextVar, Token
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from tracegym.attribution import CallTally, check_calls_later
from tracegym.client import AsyncGatewayClient, GatewayClient, SDKConfig, current_config

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class RolloutScope:
    """Where the calls and rewards made inside a ``tg.rollout`` block go."""

    rollout_id: str
    task_id: str | None = None
    agent_name: str | None = None
    config: SDKConfig = field(default_factory=current_config)
    tally: CallTally = field(default_factory=CallTally, compare=False, repr=False)
    """The calls seen for this rollout; nested scopes of the same rollout share it (``replace``)."""

    def headers(self) -> dict[str, str]:
        """The attribution headers the gateway reads, and the scope's key as ``X-Tracegym-Key`` (under
        ``tracegym run``: the rollout's token), which the gateway prefers to whatever API key the agent's
        own client sends: so an agent built with ``api_key="unused"`` works on a gateway with keys."""
        h = {"X-Rollout-Id": self.rollout_id}
        if self.config.api_key:
            h["X-Tracegym-Key"] = self.config.api_key
        if self.task_id is not None:
            h["X-Task-Id"] = self.task_id
        if self.agent_name is not None:
            h["X-Agent-Name"] = self.agent_name
        return h


_CURRENT: ContextVar[RolloutScope | None] = ContextVar("tracegym_rollout", default=None)


class NoRolloutError(RuntimeError):
    """``tg.reward``/``tg.emit`` was called with no rollout open."""


def current_rollout() -> RolloutScope | None:
    """The innermost open rollout scope in this context, or None."""
    return _CURRENT.get()


def new_rollout_id() -> str:
    return uuid.uuid4().hex


def child_scope(
    parent: RolloutScope | None,
    *,
    rollout_id: str | None,
    task_id: str | None,
    agent_name: str | None,
) -> RolloutScope:
    """The scope a ``tg.rollout(...)`` opens under ``parent``.

    With no parent, or with an explicit ``rollout_id``, or a ``task_id`` different from the parent's,
    it is a new rollout (a fresh id unless given). Otherwise it is the parent's rollout with the given
    fields overridden, so ``tg.rollout(agent_name="critic")`` inside a rollout tags that agent's calls
    without starting a new rollout.
    """
    new = parent is None or rollout_id is not None or (task_id is not None and task_id != parent.task_id)
    if new:
        config = parent.config if parent is not None else current_config()
        return RolloutScope(rollout_id or new_rollout_id(), task_id, agent_name, config)
    assert parent is not None
    return replace(parent, agent_name=agent_name if agent_name is not None else parent.agent_name)


class _Entered:
    """Sets the context variable for one ``with`` block and restores it after; at the end of the block
    that opened a rollout, checks that the rollout got calls (``tracegym.attribution``)."""

    def __init__(self, scope: RolloutScope, *, queued: bool = False) -> None:
        self.scope = scope
        self.queued = queued
        self._token: Token[RolloutScope | None] | None = None

    def __enter__(self) -> RolloutScope:
        from tracegym.instrument import install

        install()
        self._token = _CURRENT.set(self.scope)
        return self.scope

    def leave(self, exc_type: object) -> bool:
        """Restore the outer scope. True when the rollout's check is due here: the block ended without
        an exception (a failed run is not a finished rollout) and opened the rollout (a nested scope of
        the same rollout shares its tally, and its end is not the rollout's)."""
        assert self._token is not None
        _CURRENT.reset(self._token)
        outer = _CURRENT.get()
        return exc_type is None and (outer is None or outer.tally is not self.scope.tally)

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self.leave(exc_type):
            check_calls_later(self.scope, "scope_end", queued=self.queued)


def enter_scope(scope: RolloutScope) -> _Entered:
    """``with enter_scope(scope):`` makes ``scope`` current (the runner uses it with its own config, for
    a rollout it claimed from the queue)."""
    return _Entered(scope, queued=True)


class rollout:
    """Open a rollout scope: a context manager (``with``/``async with``) and a decorator (sync and async
    functions; each call of a decorated function is its own rollout unless ``rollout_id`` is fixed).

    Inside it, requests to the gateway (httpx, httpx2, requests, aiohttp) carry ``X-Rollout-Id``/
    ``X-Task-Id``/``X-Agent-Name``, and ``tg.reward``/``tg.emit`` attach to the rollout.
    ``@tg.rollout`` without parentheses works too.
    """

    def __new__(
        cls, task_id: Any = None, rollout_id: str | None = None, agent_name: str | None = None
    ) -> Any:
        if callable(task_id):  # bare @tg.rollout: return the wrapped function itself
            return cls()._wrap(task_id)
        return super().__new__(cls)

    def __init__(
        self,
        task_id: str | None = None,
        rollout_id: str | None = None,
        agent_name: str | None = None,
    ) -> None:
        self.task_id = task_id
        self.rollout_id = rollout_id
        self.agent_name = agent_name
        self._stack: list[_Entered] = []

    def _scope(self) -> RolloutScope:
        return child_scope(
            _CURRENT.get(), rollout_id=self.rollout_id, task_id=self.task_id, agent_name=self.agent_name
        )

    def __enter__(self) -> RolloutScope:
        entered = _Entered(self._scope())
        self._stack.append(entered)
        return entered.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._stack.pop().__exit__(*exc)

    async def __aenter__(self) -> RolloutScope:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)

    def __call__(self, fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"tg.rollout(...) decorates a function, got {fn!r}")
        return self._wrap(fn)

    def _wrap(self, fn: F) -> F:
        params = (self.task_id, self.rollout_id, self.agent_name)
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def awrapper(*a: Any, **kw: Any) -> Any:
                async with rollout(*params):
                    return await fn(*a, **kw)

            return awrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            with rollout(*params):
                return fn(*a, **kw)

        return wrapper  # type: ignore[return-value]


# -- rewards and events ---------------------------------------------------------------------------------
def _require_scope(what: str) -> RolloutScope:
    scope = _CURRENT.get()
    if scope is None:
        raise NoRolloutError(
            f"{what} was called outside a rollout: there is no current rollout to attach it to. Open one "
            "with `with tg.rollout(task_id=...):` (or decorate the agent function with `@tg.rollout()`), "
            "or run the agent with `tracegym run`, which opens one per queued rollout. LLM calls made "
            "outside any rollout are still recorded, under an ad-hoc rollout (its id is in the "
            "`tracegym.rollout_id` field of each response): to reward one of those, reopen it with "
            "`tg.rollout(rollout_id=...)`."
        )
    return scope


def validate_reward(value: Any) -> float:
    """``value`` as a reward: a finite real number (not a bool), which is what the gateway accepts.
    Raises TypeError or ValueError with the reason otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"a reward must be a real number, got {type(value).__name__}: {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"a reward must be finite, got {value!r}")
    return float(value)


def _reward_body(value: float, name: str | None, call_index: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {"value": validate_reward(value), "idempotency_key": uuid.uuid4().hex}
    if name is not None:
        body["name"] = name
    if call_index is not None:
        body["call_index"] = call_index
    return body


def _event_body(name: str, value_or_attributes: Any) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"an event needs a non-empty name, got {name!r}")
    body: dict[str, Any] = {"name": name, "idempotency_key": uuid.uuid4().hex}
    if isinstance(value_or_attributes, dict):
        body["attributes"] = value_or_attributes
    elif value_or_attributes is not None:
        body["value"] = value_or_attributes
    return body


def reward(value: float, *, name: str | None = None, call_index: int | None = None) -> dict[str, Any]:
    """Attach a reward to the current rollout (``name`` for a named component; ``call_index`` to pin it
    to one LLM call). Delivered at least once and counted once: retried with backoff under one
    idempotency key; raises ``GatewayUnreachableError`` if the gateway never answers. Blocking: in
    async code prefer ``await tg.areward(...)``. Returns the gateway's ``{"event_id", "duplicate"}``.
    If no LLM call of this rollout was seen yet, checks in the background that it has some
    (``tracegym.attribution``)."""
    scope = _require_scope("tg.reward()")
    body = _reward_body(value, name, call_index)
    with GatewayClient(scope.config) as client:
        out = client.add_event(scope.rollout_id, "rewards", body)
    check_calls_later(scope, "reward")
    return out


def emit(name: str, value_or_attributes: Any = None) -> dict[str, Any]:
    """Attach an event to the current rollout: a value (any JSON) or a dict of attributes. ``tracegym train``
    averages numeric values per name over each evaluation's rollouts (``emitted/<name>`` in its metrics and
    summary): ``tg.emit("tool_call", 1.0)`` reports a behaviour."""
    scope = _require_scope("tg.emit()")
    body = _event_body(name, value_or_attributes)
    with GatewayClient(scope.config) as client:
        return client.add_event(scope.rollout_id, "events", body)


async def areward(value: float, *, name: str | None = None, call_index: int | None = None) -> dict[str, Any]:
    """``tg.reward`` for async code (does not block the event loop)."""
    scope = _require_scope("tg.areward()")
    body = _reward_body(value, name, call_index)
    async with AsyncGatewayClient(scope.config) as client:
        out = await client.add_event(scope.rollout_id, "rewards", body)
    check_calls_later(scope, "reward")
    return out


async def aemit(name: str, value_or_attributes: Any = None) -> dict[str, Any]:
    """``tg.emit`` for async code."""
    scope = _require_scope("tg.aemit()")
    body = _event_body(name, value_or_attributes)
    async with AsyncGatewayClient(scope.config) as client:
        return await client.add_event(scope.rollout_id, "events", body)
