#!/usr/bin/env bash
# Install tracegym with everything (gateway, trainer, examples, dev tools) into a virtualenv.
#
# Usage: bash scripts/install.sh [VENV_DIR]     (default .venv)
#        bash scripts/install.sh --print-torch  (print the torch install it would run, install nothing)
#
# torch is installed first, pinned, and as the CPU build: on Linux an unpinned or plain PyPI torch is the
# CUDA build (GBs of wheels). Linux takes it from the PyTorch project's CPU wheel index when that answers
# within a few seconds; otherwise from the configured package index (pip's own configuration), with a
# warning. macOS wheels on PyPI are CPU (and Apple MPS) builds already.
#   TRACEGYM_TORCH=cuda   the CUDA build instead (plain PyPI on Linux), for a GPU machine
#   TRACEGYM_TORCH=configured  torch from pip's configured index, without probing the CPU index (CI here:
#                         its machines reach only the package registries, whose configuration serves the CPU build)
#   TRACEGYM_TORCH_INDEX  take torch from this index URL instead (e.g. https://download.pytorch.org/whl/cu128)
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.13.0
CPU_INDEX="${TRACEGYM_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
GPU_HINT="for the GPU (CUDA) build instead: TRACEGYM_TORCH=cuda bash scripts/install.sh"

# Exit 0 when URL answers (HTTP < 400) within 5 s, DNS included (the probe thread is abandoned after 6 s).
reachable() {
  "${PYTHON:-python3}" - "$1" <<'EOF'
import sys, threading, urllib.request

ok = []

def probe() -> None:
    try:
        with urllib.request.urlopen(sys.argv[1], timeout=5) as resp:
            ok.append(resp.status < 400)
    except Exception:
        pass

t = threading.Thread(target=probe, daemon=True)
t.start()
t.join(6)
sys.exit(0 if ok and ok[0] else 1)
EOF
}

# Print the pip arguments for torch on the first line, and why on the second.
choose_torch() {
  local os="${TRACEGYM_OS:-$(uname -s)}" spec="torch==$TORCH_VERSION"
  if [ -n "${TRACEGYM_TORCH_INDEX:-}" ]; then
    echo "$spec --index-url $TRACEGYM_TORCH_INDEX"
    echo "torch: $spec from TRACEGYM_TORCH_INDEX ($TRACEGYM_TORCH_INDEX)"
  elif [ "${TRACEGYM_TORCH:-cpu}" = "configured" ]; then
    echo "$spec"
    echo "torch: $spec from the configured package index (TRACEGYM_TORCH=configured: no probe of the CPU index)"
  elif [ "${TRACEGYM_TORCH:-cpu}" = "cuda" ]; then
    echo "$spec"
    echo "torch: $spec from the configured package index (TRACEGYM_TORCH=cuda; on Linux that is the CUDA build)"
  elif [ "$os" = "Darwin" ]; then
    echo "$spec"
    echo "torch: $spec from the configured package index (macOS wheels are CPU/MPS builds)"
  elif reachable "$CPU_INDEX/torch/"; then
    echo "$spec --index-url $CPU_INDEX"
    echo "torch: the CPU build of $spec from the PyTorch CPU index ($CPU_INDEX); $GPU_HINT"
  else
    echo "$spec"
    echo "torch: the PyTorch CPU index ($CPU_INDEX) did not answer within 5 s, so $spec comes from the" \
      "configured package index: a CPU build only if that index serves one (else the CUDA build, GBs);" \
      "TRACEGYM_TORCH_INDEX=URL picks another index"
  fi
}

if [ "${1:-}" = "--print-torch" ]; then
  choose_torch
  exit 0
fi

venv="${1:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
. "$venv/bin/activate"
PYTHON=python
python -m pip install -q --upgrade pip
choice="$(choose_torch)"
torch_args="$(echo "$choice" | sed -n 1p)"
echo "$choice" | sed -n 2p
# shellcheck disable=SC2086  # torch_args is several words on purpose
pip install -q $torch_args
pip install -q -e '.[all,dev]'
echo "installed: $(python -c 'import torch; print("torch", torch.__version__)'), tracegym $(tracegym --version | cut -d' ' -f2) in $venv"
