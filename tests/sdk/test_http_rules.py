"""The Host and Content-Type rules the gateway and the embedded engine share (``tracegym.http_rules``)."""

from __future__ import annotations

import pytest

from tracegym.http_rules import host_allowed, host_name, is_json, json_body_refused

LOOPBACK = frozenset({b"localhost", b"127.0.0.1", b"[::1]"})


@pytest.mark.parametrize(("host", "name"), [
    (b"localhost", b"localhost"), (b"LocalHost:8000", b"localhost"), (b"localhost:", b"localhost"),
    (b"[::1]", b"[::1]"), (b"[::1]:80", b"[::1]"), (b"127.0.0.1:1", b"127.0.0.1"),
    (b"localhost:80:evil", None), (b"localhost:evil", None), (b"[::1]x", None), (b"[::1]:8x", None),
    (b"[::1", None), (b":80", None), (b"", None),
])
def test_host_name(host: bytes, name: bytes | None) -> None:
    assert host_name(host) == name


def test_one_host_header_only() -> None:
    assert host_allowed([(b"host", b"localhost:8000")], LOOPBACK)
    assert not host_allowed([(b"host", b"evil.com"), (b"host", b"localhost")], LOOPBACK)
    assert not host_allowed([(b"host", b"localhost"), (b"host", b"localhost")], LOOPBACK)
    assert not host_allowed([], LOOPBACK)


def test_json_bodies_only() -> None:
    assert is_json(b"application/json; charset=utf-8") and is_json(b"application/vnd.x+json")
    assert not is_json(b"text/plain") and not is_json(b"application/jsonx")
    sized = [(b"content-length", b"2")]
    assert json_body_refused("POST", [*sized, (b"content-type", b"text/plain")])
    assert json_body_refused("POST", sized)
    assert json_body_refused("POST", [*sized, (b"content-type", b"application/json"),
                                      (b"content-type", b"application/json")])
    assert not json_body_refused("POST", [*sized, (b"content-type", b"application/json")])
    assert not json_body_refused("POST", [(b"content-length", b"0")])
    assert not json_body_refused("GET", [*sized, (b"content-type", b"text/plain")])
