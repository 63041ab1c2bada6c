"""Fixtures of the gateway tests: ``store``, a migrated trace store on SQLite and on PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tracegym.gateway.traces.store import Store


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = Store.open(store_url)
    yield s
    s.close()
