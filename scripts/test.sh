#!/usr/bin/env bash
# Install hloplan with its test dependencies into .venv (if needed) and run the test suite; a
# full run (no arguments) then checks the oldest supported jax too (scripts/test-jax-versions.sh;
# HLOPLAN_SKIP_JAX_VERSIONS=1 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test,tpu]" --config-settings editable_mode=strict
.venv/bin/ruff check .
# Two workers: one per core of a small CI machine (HLOPLAN_TEST_WORKERS=0 runs in-process).
.venv/bin/python -m pytest -m "not slow" -n "${HLOPLAN_TEST_WORKERS:-2}" "$@"
if [ "$#" -eq 0 ] && [ -z "${HLOPLAN_SKIP_JAX_VERSIONS:-}" ]; then
  bash scripts/test-jax-versions.sh
fi
