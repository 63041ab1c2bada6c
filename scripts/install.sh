#!/usr/bin/env bash
# Install tracegym with everything (gateway, trainer, examples, dev tools) into a virtualenv.
# Usage: bash scripts/install.sh [VENV_DIR]   (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
# CPU torch first, pinned: an unpinned torch would pull GBs of CUDA wheels.
pip install -q torch==2.13.0
pip install -q -e '.[all,dev]'


