"""The gateway's settings: one pydantic-settings class, read from ``TRACEGYM_*`` environment variables
(``tracegym serve`` fills them from its flags)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

SERVE_SWITCH_INTERVAL_S = 0.0005
"""``GatewaySettings.switch_interval_s`` under ``tracegym serve``."""

UpstreamKind = Literal["sglang", "openai", "litellm"]
Durability = Literal["commit", "async"]


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRACEGYM_", extra="forbid")

    upstream_url: str | None = None
    """Base URL of the inference server (SGLang / embedded engine / OpenAI-compatible); for litellm the
    optional ``api_base``."""
    upstream_urls: list[str] = Field(default_factory=list)
    """More engines beside ``upstream_url`` (``--upstream`` repeated; JSON list in the environment): one
    fleet of the same kind and model, a rollout's calls on one engine, swaps on all or none
    (``proxy/upstream/fleet.py``)."""
    upstream_health_interval_s: float = Field(default=2.0, gt=0)
    """Seconds between health checks of a fleet's engines (several upstreams only)."""
    upstream_kind: UpstreamKind = "sglang"
    upstream_api_key: str | None = None
    """Bearer key sent to the upstream (an ``sglang`` one: SGLang's ``--api-key`` or the embedded engine's
    ``TRACEGYM_ENGINE_API_KEY``)."""
    model: str | None = None
    """The served model name, also used to find the tokenizer and chat template
    (default: the upstream's ``/model_info`` ``served_model_name``)."""
    tokenizer_path: str | None = None
    """Directory with tokenizer.json/tokenizer_config.json (default: resolved from ``model``, else the
    upstream's ``/model_info`` ``tokenizer_path``)."""
    chat_format: str | None = None
    """The model family to render and parse with (``prompt/families``: ``chatml``, ``qwen3``, ``llama3``,
    ``gemma3``, ``deepseek_v3``, ``gpt_oss``; default: recognised from the tokenizer, docs/model-families.md)."""

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
    wait, several times per batch, makes the writer the bottleneck (``benchmarks.gateway_overhead``). ``tracegym serve`` sets ``SERVE_SWITCH_INTERVAL_S``; apps embedded in another process leave it."""
    freeze_gc: bool = False
    """Once started, move every object alive (modules, tokenizer, routes) out of the garbage
    collector's generations (``gc.freeze``), so a full collection scans only request-time objects (the
    tail latency under load: ``benchmarks.gateway_overhead``). ``tracegym serve`` turns it
    on; off for apps embedded in another process (tests), whose heap is not the gateway's to freeze."""
    durability: Durability = "commit"
    """``commit``: a call's final response byte (the last SSE event of a stream) is sent only once its span
    is committed to the store (group commit: whatever calls are waiting go into one transaction, committed
    by the event loop itself on SQLite, else by the recorder's threads, and each waits for its own); a span the store could not take makes the call a 503
    in its API's error shape. ``async``: answer at once and write the span in the background (a crash
    loses the spans still queued). docs/security.md."""
    commit_delay_s: float = Field(default=0.002, ge=0)
    """With ``durability="commit"``: how long the first span of a commit group may wait for the spans of
    other calls in flight, so that one transaction carries many (``traces/acks.CommitGroup``), where the
    event loop does not commit them itself (PostgreSQL; SQLite while another writer is busy). A call
    alone in the gateway never waits for it. 0: commit what is there at once."""
    commit_timeout_s: float = Field(default=10.0, gt=0)
    """With ``durability="commit"``: how long a call waits for its span's commit (a stalled or locked
    store) before it is answered 503 ``span_not_stored``; its span may still be committed later."""
    prefix_lookup_timeout_s: float = Field(default=2.0, ge=0)
    """How long a call may wait for the store lookup of its prefix parent when the prefix cache misses (a
    rollout's earlier call served by another gateway on the same store, or before a restart;
    ``proxy/prefix_lookup.py``); past it the call is planned from memory. 0 turns the lookup off."""
    max_tokens_cap: int | None = Field(default=None, gt=0)
    """The most new tokens a call may ask for (``max_tokens``, ``max_completion_tokens``,
    ``max_output_tokens``). A request above it is refused with a 400 naming the cap, as OpenAI and Anthropic
    refuse a ``max_tokens`` above a model's output limit; a request without one gets the cap. None: only
    the model's context length bounds a reply."""
    admin_key: str | None = Field(default=None, repr=False)
    """The admin key (env ``TRACEGYM_ADMIN_KEY``, ``tracegym serve --admin-key``): when set, every route but
    ``/healthz`` and the inspector's page needs it as a Bearer token; agent routes also take a rollout's
    token (``proxy/auth.py``; docs/security.md). Never logged."""
    allowed_hosts: list[str] | None = None
    """The ``Host`` names the gateway answers (any port); None: any. ``tracegym serve`` on a loopback address
    sets ``localhost``, ``127.0.0.1`` and ``[::1]`` (plus ``--allowed-host``)."""
    weights_dir: str | None = None
    """The weights root (``--weights-dir``): ``/api/weights/update`` loads only directories under it; None
    refuses weight updates from disk."""
    max_concurrent_calls: int = Field(default=1024, gt=0)
    """Inference calls this gateway serves at once (streams until their last event); one more is a 429 with
    ``Retry-After`` in its API's error shape (``proxy/admission.py``; docs/security.md)."""
    max_concurrent_calls_per_rollout: int = Field(default=64, gt=0)
    """Inference calls one rollout token may have in flight at once; one more is a 429."""
    retry_after_s: int = Field(default=1, ge=1)
    """The ``Retry-After`` seconds of a 429 for too many calls at once."""
    auth_failures_per_minute: int = Field(default=60, ge=1)
    """Requests with a missing or wrong key one client address may make per minute; past it, every request
    from that address that needs a key is a 429 until the minute's budget refills."""
    rollout_state_ttl_s: float = Field(default=2.0, ge=0)
    """How long a rollout seen open in the store is trusted before a token's next write looks again (one
    gateway learns of the rollouts it completes or fails at once; another gateway on the same store within
    this many seconds)."""
    otlp_inflight_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    """Bytes of OTLP bodies (as inflated, at worst ``max_body_bytes`` each for a compressed one) being parsed
    at once; a request past it is a 429 with ``Retry-After``, so a burst cannot hold memory beyond it."""
    header_timeout_s: float = Field(default=10.0, gt=0)
    """Seconds a connection may take to send a request's headers (from connecting, or from its request's
    first byte); then it is answered 408 and closed (``tracegym serve``; ``proxy/connections.py``)."""
    body_timeout_s: float = Field(default=60.0, gt=0)
    """Seconds a request may take to send its body once its headers are in; then 408 and closed."""
    max_connections: int = Field(default=4096, gt=0)
    """Open connections ``tracegym serve`` keeps; one more is closed at once."""

    @field_validator("chat_format")
    @classmethod
    def _known_family(cls, name: str | None) -> str | None:
        if name is not None:
            from tracegym.gateway.proxy.prompt.families import family

            family(name)  # an UnknownChatFormat (a ValueError) lists the families
        return name
