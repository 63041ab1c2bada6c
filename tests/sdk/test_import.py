"""`import tracegym` stays light: no torch, fastapi, sqlalchemy (checked in a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ["torch", "fastapi", "sqlalchemy", "transformers", "pydantic", "starlette", "numpy"]


def _modules_after(code: str) -> dict:
    probe = f"{code}\nimport json, sys, httpx\nprint(json.dumps({{'mods': sorted(sys.modules), "
    probe += "'patched': hasattr(httpx.Client.send, '__tracegym_instrumented__')}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_tracegym_is_light() -> None:
    got = _modules_after("import tracegym as tg; tg.reward; tg.rollout; tg.emit; tg.configure")
    heavy = [m for m in HEAVY if m in got["mods"]]
    assert heavy == [], f"import tracegym pulled in {heavy}"
    assert not got["patched"], "import alone must not patch httpx (the first tg.rollout does)"


def test_runner_and_export_modules_are_light() -> None:
    got = _modules_after("import tracegym.runner, tracegym.queue_commands, tracegym.export, tracegym.cli")
    assert [m for m in HEAVY if m in got["mods"]] == []


def test_first_scope_installs_instrumentation() -> None:
    got = _modules_after("import tracegym as tg\nwith tg.rollout(): pass")
    assert got["patched"]
