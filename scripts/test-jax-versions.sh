#!/usr/bin/env bash
# Check the oldest supported jax minor: make .venv-jax09 with the newest jax 0.9.x (the range in
# pyproject.toml is jax>=0.9,<0.11) and run a smoke subset there: plan a bundled train step, run
# the plan on 8 simulated CPU devices against the single-device program, and the fixture
# numerics test of one program. scripts/test.sh covers the newest jax (0.10.x) in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
JAX_VERSION="${JAX_VERSION:-0.9.2}"
VENV="${VENV:-.venv-jax09}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e . "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" pytest hypothesis \
  --config-settings editable_mode=strict
"$VENV/bin/python" -c 'import jax; print("jax", jax.__version__)'
export XLA_FLAGS=--xla_force_host_platform_device_count=8
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
"$VENV/bin/hloplan" compile fixtures/mlp_train_step.jaxexport --mesh 2x4 --device toy -q -o "$out/plan"
"$VENV/bin/hloplan" run "$out/plan" --check --inputs fixtures/mlp_train_step.inputs.npz
"$VENV/bin/python" -m pytest -p no:cacheprovider tests/numerics/test_fixtures_numerics.py -k mlp_train_step
