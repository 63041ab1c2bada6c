"""tracegym SDK: ``tg.reward``, ``tg.emit``, ``tg.rollout``. Imports nothing heavy (httpx only)."""

from __future__ import annotations

__version__ = "0.1.0"
