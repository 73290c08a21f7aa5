#!/usr/bin/env bash
# Regenerates requirements/cpu.lock (every package of the CPU test environment pinned) from pyproject.toml and
# requirements/cpu.txt with pip-tools, installed into a throwaway venv. Run from anywhere; resolves for this
# machine's Python (3.11, Linux x86_64) with the configured indexes (torch 2.13.0+cpu comes from their find-links).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(mktemp -d)"
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q pip-tools==7.6.2
CUSTOM_COMPILE_COMMAND="requirements/compile-lock.sh" "$venv/bin/pip-compile" -q --allow-unsafe --strip-extras \
    --no-emit-find-links --no-emit-index-url --no-emit-trusted-host --extra test --extra fla \
    --output-file requirements/cpu.lock pyproject.toml requirements/cpu.txt
