#!/usr/bin/env bash
# The test command (README): lint, then the whole suite, slow tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
python -m pytest -q -ra --durations=15 "$@"
