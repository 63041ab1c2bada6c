#!/usr/bin/env bash
# The test command (README): lint, import contracts, then the whole suite, slow tests included.
# Fast suite only: bash scripts/test.sh -m "not slow" -n 3 --dist loadgroup  (arguments go to one pytest run)
set -euo pipefail
cd "$(dirname "$0")/.."
# Python keeps the bytecode of the project's modules (an environment may set PYTHONDONTWRITEBYTECODE): else
# every server a test starts compiles them again, and pytest rewrites every test module at each collection
unset PYTHONDONTWRITEBYTECODE
ruff check .
bash scripts/lint_imports.sh
if [ "$#" -ne 0 ]; then exec python -m pytest -q -ra --durations=15 "$@"; fi
# The whole run: the client libraries' other majors first (openai 3, anthropic 1, newest openai-agents), then
# the fast tests three at a time on two cores (pytest-xdist: much of a test is waiting on the child processes
# it starts; --dist loadgroup keeps a module with module-scoped fixtures on one worker: tests/conftest.py),
# then the slow ones one at a time (each trains or serves a model on both cores), so that the slow
# suite's summary is last.
bash scripts/test_next_majors.sh
python -m pytest -q -ra --durations=15 -m "not slow" -n 3 --dist loadgroup
python -m pytest -q -ra --durations=15 -m slow
