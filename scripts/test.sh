#!/usr/bin/env bash
# The test command (README): lint, import contracts, then the whole suite, slow tests included.
# Fast suite only: bash scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
bash scripts/lint_imports.sh
# The whole run first tests the client libraries' other majors (openai 3, anthropic 1, newest openai-agents),
# so that the main suite's summary is the last line.
if [ "$#" -eq 0 ]; then bash scripts/test_next_majors.sh; fi
python -m pytest -q -ra --durations=15 "$@"
