#!/usr/bin/env bash
# Check the import contracts in pyproject.toml ([tool.importlinter]) with lint-imports.
# tracegym's folders (sdk/, gateway/, trainer/, engine/, modelfiles/) form one package through setuptools' package-dir
# mapping, which import-linter cannot follow; so the check runs on a copy laid out as one package tree.
set -euo pipefail
cd "$(dirname "$0")/.."
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/tracegym"
cp -r sdk/. "$tree/tracegym/"
cp -r gateway "$tree/tracegym/gateway"
cp -r trainer "$tree/tracegym/trainer"
cp -r engine "$tree/tracegym/engine"
cp -r modelfiles "$tree/tracegym/modelfiles"
cp pyproject.toml "$tree/"
cd "$tree" && PYTHONPATH="$tree" lint-imports --no-cache
