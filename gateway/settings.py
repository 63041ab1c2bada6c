"""The gateway's settings: one pydantic-settings class, read from ``TRACEGYM_*`` environment variables
(``tracegym serve`` fills them from its flags)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

SERVE_SWITCH_INTERVAL_S = 0.0005
"""``GatewaySettings.switch_interval_s`` under ``tracegym serve``."""

UpstreamKind = Literal["sglang", "openai", "litellm"]


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRACEGYM_", extra="forbid")

    upstream_url: str | None = None
    """Base URL of the inference server (SGLang / embedded engine / OpenAI-compatible); for litellm the
    optional ``api_base``."""
    upstream_kind: UpstreamKind = "sglang"
    upstream_api_key: str | None = None
    """Bearer key sent to an ``openai``/``litellm`` upstream."""
    model: str | None = None
    """The served model name, also used to find the tokenizer and chat template
    (default: the upstream's ``/model_info`` ``served_model_name``)."""
    tokenizer_path: str | None = None
    """Directory with tokenizer.json/tokenizer_config.json (default: resolved from ``model``, else the
    upstream's ``/model_info`` ``tokenizer_path``)."""
    store_url: str | None = "sqlite:///./tracegym.db"
    """SQLAlchemy URL of the trace store; None turns recording (and the control API) off."""
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    upstream_timeout: float = Field(default=600.0, gt=0)
    """Seconds the upstream may stay silent (no response byte) before the call fails with 504."""
    upstream_connect_timeout: float = Field(default=10.0, gt=0)
    upstream_max_connections: int = Field(default=4096, gt=0)
    health_timeout: float = Field(default=2.0, gt=0)
    switch_interval_s: float | None = Field(default=None, gt=0)
    """The interpreter's thread switch interval (``sys.setswitchinterval``) once started; None leaves it
    (5 ms by default). The span recorder's write thread releases the GIL inside each SQLite statement and
    must win it back from the encoding thread, which holds it until the interval runs out: at 5 ms that
    wait, several times per batch, made the writer the bottleneck. Measured (benchmarks/store_ingest.py,
    SQLite, 8 alternating runs each): median 38,000 spans/s at 5 ms, 41,200 at 1 ms, 45,200 at 0.5 ms.
    ``tracegym serve`` sets ``SERVE_SWITCH_INTERVAL_S``; apps embedded in another process leave it."""
    freeze_gc: bool = False
    """Once started, move every object alive (modules, tokenizer, routes: ~100k objects) out of the garbage
    collector's generations (``gc.freeze``), so a full collection scans only request-time objects. Measured
    at 32 concurrent chat calls with recording: p99 latency 45 ms -> 10 ms. ``tracegym serve`` turns it
    on; off for apps embedded in another process (tests), whose heap is not the gateway's to freeze."""
