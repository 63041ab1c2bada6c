"""The trainer's HTTP client for the gateway's weight routes: the SDK's ``GatewayClient`` (its key lookup:
the run's admin key, else ``$TRACEGYM_API_KEY`` / ``$TRACEGYM_ADMIN_KEY``, and its retries), with every
answer checked the same way."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from tracegym.client import GatewayClient, GatewayError, config_for, current_config


class WeightSyncError(RuntimeError):
    """The gateway (or the engine behind it) refused or failed a weight update; the message says why."""


def weights_client(gateway_url: str, api_key: str | None, timeout: float) -> GatewayClient:
    """A client of the gateway at ``gateway_url`` with ``api_key`` (default: the SDK's configured key)."""
    config = config_for(gateway_url, current_config())
    return GatewayClient(replace(config, api_key=api_key or config.api_key, timeout=timeout))


def post_checked(client: GatewayClient, route: str, body: dict[str, Any], *, idempotent: bool = True) -> dict[str, Any]:
    """POST ``body`` to ``route``; the answer, or ``WeightSyncError`` when the gateway refuses or reports
    ``success: false``. A swap to a named version is safe to repeat, so it is retried as the SDK retries."""
    try:
        resp = client.request("POST", route, route, idempotent=idempotent, json=body)
    except GatewayError as e:
        raise WeightSyncError(str(e)) from e
    try:
        answer = resp.json()
    except ValueError:
        answer = {"text": resp.text}
    if isinstance(answer, dict) and answer.get("success") is False:
        raise WeightSyncError(f"{route}: gateway answered {resp.status_code}: {json.dumps(answer)}")
    return answer if isinstance(answer, dict) else {"body": answer}


def stream_checked(client: GatewayClient, route: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """POST ``body`` to ``route`` and yield each event of its NDJSON answer (sent once, never repeated)."""
    try:
        for line in client.iter_lines(route, route, method="POST", body=body):
            yield json.loads(line)
    except GatewayError as e:
        raise WeightSyncError(str(e)) from e
