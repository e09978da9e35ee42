#!/usr/bin/env bash
# Install hloplan with its test dependencies into .venv (if needed) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test,tpu]" --config-settings editable_mode=strict
.venv/bin/ruff check .
.venv/bin/python -m pytest -m "not slow" "$@"
