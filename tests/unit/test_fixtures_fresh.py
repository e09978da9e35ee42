"""The committed fixtures in fixtures/ match a fresh export of fixtures/models.py.

The export-based checks run fixtures/generate.py in a subprocess (it pins JAX to the CPU
platform via JAX_PLATFORMS, which must not leak into this test process).  The remaining
checks only read files and need no JAX.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURES = REPO_ROOT / "fixtures"
GENERATE = FIXTURES / "generate.py"
SIZE_BUDGET = 2 * 1024 * 1024

EXPECTED = {
    "mlp_train_step",
    "gpt_train_step",
    "scan_train_step",
    "scan_forward",
    "convnet_train_step",
    "mlp_forward",
    "misc_ops",
}


def _manifest() -> dict:
    return json.loads((FIXTURES / "manifest.json").read_text())


def _run_generate(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(GENERATE), *flags],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_generate_check_is_clean():
    """A fresh export is byte-identical to the committed files (run from the repo root)."""
    proc = _run_generate("--check")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def test_roundtrip_and_numerics():
    """Every .jaxexport deserializes, and exported.call(inputs) == jax.jit(fn)(inputs)."""
    proc = _run_generate("--verify")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def test_manifest_lists_every_fixture_and_matches_files():
    manifest = _manifest()
    names = [f["name"] for f in manifest["fixtures"]]
    assert set(names) == EXPECTED and len(names) == len(EXPECTED)
    for entry in manifest["fixtures"]:
        name = entry["name"]
        expected_files = {f"{name}.mlir", f"{name}.jaxexport", f"{name}.inputs.npz"}
        if name == "mlp_train_step":
            expected_files.add(f"{name}.vhlo")
        assert set(entry["files"]) == expected_files
        for fname, meta in entry["files"].items():
            data = (FIXTURES / fname).read_bytes()
            assert len(data) == meta["bytes"], fname
            assert hashlib.sha256(data).hexdigest() == meta["sha256"], fname
        assert entry["platforms"] == ["cpu"]
        assert entry["in_tree"].startswith("PyTreeDef((")
        assert entry["nr_devices"] == 1


def test_inputs_match_manifest():
    for entry in _manifest()["fixtures"]:
        with np.load(FIXTURES / f"{entry['name']}.inputs.npz") as npz:
            assert sorted(npz.files, key=lambda k: int(k[3:])) == [
                spec["key"] for spec in entry["inputs"]
            ]
            for spec in entry["inputs"]:
                arr = npz[spec["key"]]
                assert list(arr.shape) == spec["shape"], (entry["name"], spec)
                assert str(arr.dtype) == spec["dtype"], (entry["name"], spec)
                if arr.dtype.kind == "f":
                    assert np.all(np.isfinite(arr)), (entry["name"], spec)


def test_mlir_locations_are_relative():
    for entry in _manifest()["fixtures"]:
        text = (FIXTURES / f"{entry['name']}.mlir").read_text()
        assert '"fixtures/models.py"' in text, entry["name"]
        assert str(REPO_ROOT) not in text and "/work/" not in text, entry["name"]
        assert "generate.py" not in text, entry["name"]
        assert text.lstrip().startswith("#loc") or text.lstrip().startswith("module")


def test_fixture_payload_is_small():
    total = sum(p.stat().st_size for p in FIXTURES.iterdir() if p.is_file())
    assert total < SIZE_BUDGET, f"fixtures/ is {total} bytes"


@pytest.mark.parametrize(
    "name, needles",
    [
        ("misc_ops", ["stablehlo.case", "stablehlo.optimization_barrier", "stablehlo.sort",
                      "stablehlo.concatenate", "stablehlo.reduce_window", "@_where",
                      "call @_shared_helper"]),
        ("scan_forward", ["stablehlo.while"]),
        ("scan_train_step", ["stablehlo.while", "stablehlo.dynamic_update_slice"]),
        ("gpt_train_step", ['"stablehlo.gather"', '"stablehlo.scatter"', "stablehlo.dot_general"]),
        ("convnet_train_step", ["stablehlo.convolution", "stablehlo.reduce_window",
                                "stablehlo.select_and_scatter"]),
    ],
)  # fmt: skip
def test_fixture_exercises_expected_ops(name, needles):
    text = (FIXTURES / f"{name}.mlir").read_text()
    for needle in needles:
        assert needle in text, (name, needle)
    if name == "misc_ops":
        # one private function, two call sites
        assert text.count("call @_shared_helper(") == 2
        assert text.count("func.func private @_shared_helper(") == 1
