"""Name lookup shared by every algorithm registry (advantage estimators, policy losses, aggregations, KL).

Each registry is a plain ``dict[str, Callable]`` owned by the module that defines its functions; this
module only provides the one dispatch path, so an unknown name fails the same way everywhere: with the
list of valid names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


class UnknownNameError(ValueError):
    """A registry was asked for a name it does not hold; the message lists the valid ones."""


def lookup(table: Mapping[str, T], name: str, kind: str) -> T:
    """Return ``table[name]``, or raise ``UnknownNameError`` naming ``kind`` and listing the valid names."""
    try:
        return table[name]
    except (KeyError, TypeError):
        valid = ", ".join(sorted(table))
        raise UnknownNameError(f"unknown {kind} {name!r}; valid: {valid}") from None
