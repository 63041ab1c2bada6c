"""The HTTP rules the gateway and the embedded engine both apply before any route (docs/security.md):
which ``Host`` header names a loopback-bound server answers, how a ``Host`` header is read (a name and an
optional numeric port, nothing else), and which ``Content-Type`` counts as JSON. Pure functions over the
raw header bytes of an ASGI scope; no imports, so both sides (and the SDK) can use them."""

from __future__ import annotations

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
"""The default allow-list of a loopback-bound server (any port)."""
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def host_name(host: bytes) -> bytes | None:
    """The lower-cased name of a ``Host`` header (``[::1]:8000`` → ``[::1]``, ``LocalHost:80`` →
    ``localhost``), or None when it is not ``name[:port]`` with a numeric port (``localhost:80:evil``,
    ``[::1]x``, an empty name)."""
    if host.startswith(b"["):
        end = host.find(b"]")
        if end < 0:
            return None
        name, rest = host[:end + 1], host[end + 1:]
        if rest and (rest[:1] != b":" or not (rest[1:].isdigit() or rest == b":")):
            return None
    else:
        name, _, port = host.partition(b":")
        if not name or (port and not port.isdigit()):
            return None
    return name.lower()


def is_json(content_type: bytes) -> bool:
    """``application/json`` or an ``application/...+json`` type, whatever its parameters."""
    media = content_type.partition(b";")[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


def has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request's headers announce a body (chunked, or a non-zero ``Content-Length``)."""
    return any(k == b"transfer-encoding" or (k == b"content-length" and v.strip() != b"0") for k, v in headers)


def host_allowed(headers: list[tuple[bytes, bytes]], allowed: frozenset[bytes]) -> bool:
    """Exactly one ``Host`` header, well formed, whose name is in ``allowed`` (lower-case names)."""
    seen = None
    for k, v in headers:
        if k == b"host":
            if seen is not None:
                return False
            seen = v
    name = host_name(seen) if seen is not None else None
    return name is not None and name in allowed


def json_body_refused(method: str, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request sends a body (``POST``/``PUT``/``PATCH``) without exactly one JSON
    ``Content-Type``: a browser sends a cross-site ``text/plain`` POST without asking first, a JSON one only
    after a CORS preflight that neither server grants."""
    if method not in BODY_METHODS or not has_body(headers):
        return False
    types = [v for k, v in headers if k == b"content-type"]
    return len(types) != 1 or not is_json(types[0])
