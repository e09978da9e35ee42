"""Shared test setup.

XLA reads XLA_FLAGS once, when jax initialises its backends, so the 8 simulated CPU devices the
sharded plans run on must be requested here, before any test module (or hloplan) imports jax.

Tests marked `slow` are skipped unless `--runslow` is given (or HLOPLAN_RUN_SLOW=1, or an explicit
`-m` expression that selects them, e.g. `pytest -m slow`); tests marked `libtpu` are skipped where
libtpu is not installed.
"""

from __future__ import annotations

import os
import re
import sys

DEVICE_COUNT = 8
_DEVICE_FLAG = "--xla_force_host_platform_device_count"

_flags = re.sub(rf"{_DEVICE_FLAG}=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
# The suite checks results, not speed: XLA's CPU backend with LLVM at -O0 compiles the sharded
# programs about three times faster (the same HLO passes, so the same buffers and collectives).
_FAST_COMPILE = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
os.environ["XLA_FLAGS"] = " ".join([*_flags, *(f for f in _FAST_COMPILE if f.split("=")[0] not in
                                                " ".join(_flags)),
                                    f"{_DEVICE_FLAG}={DEVICE_COUNT}"])
# if jax got imported before this file (a plugin, `python -c 'import jax; pytest.main()'`) the
# flag above came too late; device fixtures skip with this reason instead of failing obscurely
JAX_PREIMPORTED = "jax" in sys.modules

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES_DIR = REPO_ROOT / "fixtures"


# --------------------------------------------------------------------------- slow tests


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    from hloplan.tpu import libtpu_available

    if not libtpu_available():
        no_libtpu = pytest.mark.skip(reason="libtpu is not installed (pip install '.[tpu]')")
        for item in items:
            if "libtpu" in item.keywords:
                item.add_marker(no_libtpu)
    if (config.getoption("--runslow") or os.environ.get("HLOPLAN_RUN_SLOW") == "1"
            or "slow" in (config.getoption("-m") or "")):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow or HLOPLAN_RUN_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# --------------------------------------------------------------------------- helpers


def cpu_devices(count: int = DEVICE_COUNT) -> list:
    """`count` CPU devices (the simulated ones), or skip the test."""
    import jax

    devices = jax.devices("cpu")
    if len(devices) < count:
        why = ("jax was imported before tests/conftest.py set XLA_FLAGS" if JAX_PREIMPORTED
               else f"XLA_FLAGS did not give {count} CPU devices")
        pytest.skip(f"need {count} CPU devices, have {len(devices)}: {why}")
    return devices[:count]


def load_exported(path_or_bytes):
    """A jax.export.Exported from a .jaxexport path or serialized bytes."""
    from jax import export

    data = path_or_bytes if isinstance(path_or_bytes, (bytes, bytearray)) else Path(path_or_bytes).read_bytes()
    return export.deserialize(bytearray(data))


def fixture_arguments(name: str):
    """(exported, args, kwargs) for fixtures/<name>.jaxexport and its .inputs.npz."""
    import jax

    exported = load_exported(FIXTURES_DIR / f"{name}.jaxexport")
    with np.load(FIXTURES_DIR / f"{name}.inputs.npz") as data:
        leaves = [data[f"arg{i}"] for i in range(len(exported.in_avals))]
    args, kwargs = jax.tree.unflatten(exported.in_tree, leaves)
    return exported, args, kwargs


def single_device_call(exported, args, kwargs=None):
    """The exported program run unsharded on one CPU device; numpy leaves."""
    import jax

    device = cpu_devices(1)[0]
    args, kwargs = jax.device_put((args, kwargs or {}), device)
    with jax.default_device(device):
        out = jax.jit(exported.call)(*args, **kwargs)
    return jax.tree.map(np.asarray, out)


def assert_trees_close(got, want, rtol: float = 1e-4, atol: float = 1e-5, context: str = "") -> None:
    """Same structure, shapes and dtypes; floats allclose(rtol, atol), everything else exact."""
    import jax

    got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(want)
    assert got_tree == want_tree, f"{context}: output structure {got_tree} != {want_tree}"
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        where = f"{context}: output {jax.tree_util.keystr(path)}"
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, f"{where}: shape {g.shape} != {w.shape}"
        assert g.dtype == w.dtype, f"{where}: dtype {g.dtype} != {w.dtype}"
        if np.issubdtype(w.dtype, np.inexact):
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=where)
        else:
            np.testing.assert_array_equal(g, w, err_msg=where)


def spec_is_sharded(spec) -> bool:
    """A plan.json spec (one list of mesh axes per dimension) splits some dimension."""
    return any(len(axes) > 0 for axes in spec)


def plan_is_sharded(plan: dict) -> bool:
    return any(spec_is_sharded(arg["spec"]) for arg in plan["arguments"])


# --------------------------------------------------------------------------- fixtures


def mlp_train_step_export(width: int, hidden: int, batch: int, platforms=("cpu",)):
    """A two-layer MLP train step (tanh, mean squared error, SGD) on abstract f32 arguments,
    parameters donated, exported with jax.export for `platforms`."""
    import jax
    import jax.numpy as jnp
    from jax import export

    def loss(params, x, y):
        h = jnp.tanh(x @ params["w1"])
        return jnp.mean((h @ params["w2"] - y) ** 2)

    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    f32 = jnp.float32
    params = {"w1": jax.ShapeDtypeStruct((width, hidden), f32),
              "w2": jax.ShapeDtypeStruct((hidden, width), f32)}
    args = (params, jax.ShapeDtypeStruct((batch, width), f32),
            jax.ShapeDtypeStruct((batch, width), f32))
    return export.export(jax.jit(step, donate_argnums=(0,)), platforms=platforms)(*args)


@pytest.fixture(scope="session")
def devices8():
    return cpu_devices(DEVICE_COUNT)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES_DIR


@pytest.fixture(scope="session")
def helpers():
    """The helper functions above, for test modules (importing conftest is fragile)."""
    from types import SimpleNamespace

    return SimpleNamespace(cpu_devices=cpu_devices, load_exported=load_exported,
                           fixture_arguments=fixture_arguments,
                           single_device_call=single_device_call,
                           assert_trees_close=assert_trees_close,
                           spec_is_sharded=spec_is_sharded, plan_is_sharded=plan_is_sharded,
                           mlp_train_step_export=mlp_train_step_export)
