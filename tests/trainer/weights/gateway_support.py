"""A real gateway in a thread, in front of an engine or the SGLang fake, for the weight-push tests."""

from __future__ import annotations

from pathlib import Path

from tests.gateway.app_support import MemoryRecorder, ServerThread
from tracegym.gateway.app import create_app
from tracegym.gateway.settings import GatewaySettings


def weights_gateway(upstream: str, model_dir: Path, kind: str = "sglang", weights_dir: Path | None = None) -> ServerThread:
    """``weights_dir``: the gateway's weights root (pytest's base temporary directory holds every tmp_path)."""
    settings = GatewaySettings(upstream_url=upstream, upstream_kind=kind, model=str(model_dir), store_url=None,
                               weights_dir=str(weights_dir) if weights_dir else None)
    return ServerThread(create_app(settings, recorder=MemoryRecorder()))
