#!/usr/bin/env bash
# Install hloplan into .venv and plan + run the bundled GPT-style train step on 8 simulated CPU devices.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e . --config-settings editable_mode=strict
export XLA_FLAGS=--xla_force_host_platform_device_count=8
.venv/bin/hloplan compile fixtures/gpt_train_step.jaxexport --mesh 2x4 --device toy -o plan/
.venv/bin/hloplan run plan/ --check --inputs fixtures/gpt_train_step.inputs.npz
