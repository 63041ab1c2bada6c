"""The gateway behind a command that talks to one (``tracegym enqueue``, ``run``, ``export``): one quick look
before the work starts, so a wrong or missing gateway fails in seconds rather than after the client's
retries, and an unreachable gateway said in the command line's terms (``--gateway``, ``$TRACEGYM_GATEWAY``;
``tg.configure`` is the SDK's, not the CLI's)."""

from __future__ import annotations

import os

import httpx

from tracegym.client import GatewayUnreachableError
from tracegym.errors import UserError

CHECK_TIMEOUT_S = 3.0
"""How long the look at ``/healthz`` may take: a command with no gateway fails well within 5 s."""

FIX = "start one (tracegym serve ...), or pass its URL with --gateway URL or $TRACEGYM_GATEWAY"


def url_source(given: str | None) -> str:
    """Where the gateway URL came from, as the user set it."""
    if given:
        return "--gateway"
    if os.environ.get("TRACEGYM_GATEWAY"):
        return "$TRACEGYM_GATEWAY"
    return "the default: no --gateway or $TRACEGYM_GATEWAY given"


def check_gateway(url: str, given: str | None = None) -> None:
    """A ``UserError`` unless something answers HTTP at ``url`` within ``CHECK_TIMEOUT_S``; ``given`` is the
    ``--gateway`` value (None: the URL came from the environment or the default)."""
    try:
        httpx.get(url + "/healthz", timeout=CHECK_TIMEOUT_S)
    except httpx.TransportError as e:
        raise UserError(f"no tracegym gateway answers at {url} ({url_source(given)}; {type(e).__name__})",
                        FIX) from None


def lost_gateway(command: str, url: str, error: GatewayUnreachableError, given: str | None = None) -> UserError:
    """The ``UserError`` of a gateway that stopped answering while ``command`` (e.g. ``the export``) ran."""
    last = error.last or str(error)
    return UserError(f"the gateway at {url} ({url_source(given)}) stopped answering during {command} ({last})",
                     FIX)
