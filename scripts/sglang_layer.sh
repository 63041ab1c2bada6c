#!/usr/bin/env bash
# SGLang 0.5.23's own code, importable on a CPU machine, as the judge of our SGLang adapter
# (tests/e2e/test_sglang_classes.py): `pip install --no-deps --target` of sglang plus the CPU-importable
# modules that importing `sglang.srt.managers.io_struct` pulls in and the project's virtualenv lacks.
# sglang's own pins are kept where it has them (apache-tvm-ffi, compressed-tensors, sentencepiece); torch
# and transformers are the venv's (sglang pins torch 2.14.1 / transformers 5.19.0). GPU-only imports
# (triton, torchvision: its PyPI wheels do not load with the CPU torch) are stood in for by
# tests/e2e/sglang_standins.py, never installed. Cached: reinstalls only when the list below changes.
# Usage: bash scripts/sglang_layer.sh   (inside the project's virtualenv; prints the layer's path)
set -euo pipefail
cd "$(dirname "$0")/.."
layer="${TRACEGYM_SGLANG_LAYER_DIR:-.sglang-layer}"
want=(
  "sglang==0.5.23"
  "pybase64==1.5.1" "pyzmq==27.3.0" "dill==0.4.1" "partial-json-parser==0.2.1.1.post7"
  "apache-tvm-ffi==0.1.11" "compressed-tensors==0.18.0" "loguru==0.7.3" "sentencepiece==0.2.1"
  "ipython==9.18.1" "traitlets==5.16.1" "ipython-pygments-lexers==1.1.1" "decorator==5.3.1"
  "matplotlib-inline==0.2.2" "stack-data==0.6.3" "executing==2.3.0" "asttokens==3.0.2" "pure-eval==0.2.4"
  "jedi==0.20.1" "parso==0.8.7" "prompt-toolkit==3.0.53" "wcwidth==0.9.4" "pexpect==4.9.0"
  "ptyprocess==0.7.0"
)
if [ ! -f "$layer/.installed" ] || [ "$(cat "$layer/.installed")" != "${want[*]}" ]; then
  rm -rf "$layer"
  pip install -q --disable-pip-version-check --no-deps --target "$layer" "${want[@]}" 2>&1 \
    | grep -v "^WARNING: Location\|^WARNING: Target directory" >&2 || true
  [ -d "$layer/sglang-0.5.23.dist-info" ] || { echo "sglang 0.5.23 did not install into $layer" >&2; exit 1; }
  echo "${want[*]}" > "$layer/.installed"
fi
echo "$PWD/$layer"
