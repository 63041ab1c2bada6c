#!/usr/bin/env bash
# The client-library tests again with the other majors of the SDKs agents bring: the main environment has
# openai 2.x, anthropic 2.x and openai-agents 0.20 (litellm needs openai<3); this lays openai 3.x (over
# httpx2), anthropic 1.x (over httpx) and the newest openai-agents (which needs openai 3) over it in a
# directory put first on PYTHONPATH, and runs the tests that drive those libraries.
# Usage: bash scripts/test_next_majors.sh [pytest args]   (inside the project's virtualenv)
set -euo pipefail
cd "$(dirname "$0")/.."
layer="${TRACEGYM_NEXT_MAJORS_DIR:-.next-majors}"
want=("openai>=3,<4" "anthropic>=1,<2" "openai-agents>=0.24")
if [ ! -f "$layer/.installed" ] || [ "$(cat "$layer/.installed")" != "${want[*]}" ]; then
  rm -rf "$layer"
  pip install -q --disable-pip-version-check --no-deps --target "$layer" "${want[@]}" 2>&1 | grep -v "^WARNING: Location" || true
  echo "${want[*]}" > "$layer/.installed"
fi
PYTHONPATH="$PWD/$layer${PYTHONPATH:+:$PYTHONPATH}" python - <<'PY'
import anthropic, agents, openai  # noqa: E401
from importlib.metadata import version
print(f"== next majors: openai {openai.__version__}, anthropic {anthropic.__version__}, "
      f"openai-agents {version('openai-agents')}")
assert openai.__version__.startswith("3.") and anthropic.__version__.startswith("1."), "the layer is not first"
PY
PYTHONPATH="$PWD/$layer${PYTHONPATH:+:$PYTHONPATH}" python -m pytest -q -p no:cacheprovider \
  tests/sdk/test_instrument_gateway.py tests/e2e/test_api_clients.py tests/e2e/test_agent_frameworks.py "$@"
