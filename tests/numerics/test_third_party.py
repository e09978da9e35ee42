"""Train steps written with flax, equinox and keras (examples/third_party/), exported the way
their docs suggest, planned with hloplan and compared with the single-device program.

Each library is optional: its cases skip when it is not installed.  One mesh per model, and
one model per library unless --runslow, keeps the module near half a minute;
`python examples/third_party/<library>_train_step.py --check` runs every model on every mesh.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import importlib.util  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "third_party"

# (test id, example script, model, keyword arguments, mesh, libraries the model needs, marks);
# one case per
# library runs by default, the rest (bigger plans, more XLA compiles) only with --runslow.
SLOW = pytest.mark.slow
CASES = [
    ("nnx_transformer_1layer-8", "flax_train_step", "nnx_transformer", {"layers": 1}, "8",
     ("flax", "optax"), ()),
    ("linen_mlp-4x2", "flax_train_step", "linen_mlp", {}, "4x2", ("flax", "optax"), ()),
    ("eqx_mlp-2x4", "equinox_train_step", "eqx_mlp", {}, "2x4", ("equinox", "optax"), ()),
    ("keras_cnn-2x4", "keras_train_step", "keras_cnn", {}, "2x4", ("keras",), ()),
    ("nnx_transformer-2x4", "flax_train_step", "nnx_transformer", {}, "2x4", ("flax", "optax"),
     (SLOW,)),
    ("eqx_cnn-4x2", "equinox_train_step", "eqx_cnn", {}, "4x2", ("equinox", "optax"), (SLOW,)),
    ("keras_mlp-8", "keras_train_step", "keras_mlp", {}, "8", ("keras",), (SLOW,)),
]


def _import_library(name: str):
    if name == "keras":
        # Keras picks its backend once, at import; without this it wants tensorflow.
        os.environ["KERAS_BACKEND"] = "jax"
        keras = pytest.importorskip("keras")
        if keras.backend.backend() != "jax":
            pytest.skip(f"keras was imported with the {keras.backend.backend()} backend")
        return keras
    return pytest.importorskip(name)


def _example(script: str):
    """examples/third_party/SCRIPT.py as a module (its directory is not a package)."""
    name = f"hloplan_example_{script}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "script, model, kwargs, mesh, libraries",
    [pytest.param(*case[1:6], marks=case[6], id=case[0]) for case in CASES],
)
def test_third_party_train_step(script, model, kwargs, mesh, libraries, devices8, helpers,
                                tmp_path):
    for library in libraries:
        _import_library(library)
    import jax

    import hloplan

    example = _example(script)
    step, args = example.MODELS[model](**kwargs)
    data = example._common.export_step(step, args)

    result = hloplan.compile(data, mesh, output=tmp_path / "plan", device="toy")
    plan = result.plan
    fallbacks = [(op["op"], op["location"]) for op in plan["ops"] if op["replicated_fallback"]]
    assert not fallbacks, f"ops planned as replicated: {fallbacks}"
    warnings = [entry.format(model) for entry in result.state.log.entries
                if entry.severity in ("warning", "error")]
    assert not warnings, warnings
    assert helpers.plan_is_sharded(plan), "no argument of the plan is sharded"

    run = hloplan.load(tmp_path / "plan", devices=devices8)
    got = jax.device_get(run(*args))
    exported = helpers.load_exported(data)
    want = helpers.single_device_call(exported, args)
    helpers.assert_trees_close(got, want, context=f"{model} on mesh {mesh}")
