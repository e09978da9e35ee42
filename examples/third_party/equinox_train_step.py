"""Equinox train steps (MLP, small CNN) with optax AdamW, exported for hloplan.

    pip install equinox optax
    python examples/third_party/equinox_train_step.py -o exports/            # write the .jaxexport files
    python examples/third_party/equinox_train_step.py -o exports/ --check    # + plan and check on 8 CPU devices
    hloplan compile exports/eqx_cnn.jaxexport --mesh 2x4 -o plan/ && hloplan run plan/ --check

The step is the one from the equinox docs (`eqx.filter_value_and_grad`, `optim.update(grads,
opt_state, eqx.filter(model, eqx.is_array))`, `eqx.apply_updates`).  To export it as a pure
function of arrays, the model is split with `eqx.partition(model, eqx.is_array)`: the static
half is closed over, the array half and the optax state cross the step boundary as flat lists
of leaves (`Exported.serialize()` cannot serialize equinox Modules or optax's NamedTuples).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402  (sets XLA_FLAGS before jax is imported)

BATCH = 16


def _train_step(model, loss_fn, optim):
    """The equinox-docs train step, as a pure function of flat lists of arrays."""
    import equinox as eqx
    import jax

    params, static = eqx.partition(model, eqx.is_array)
    param_leaves, param_tree = jax.tree.flatten(params)
    opt_leaves, opt_tree = jax.tree.flatten(optim.init(params))

    def step(param_leaves, opt_leaves, x, y):
        model = eqx.combine(jax.tree.unflatten(param_tree, param_leaves), static)
        opt_state = jax.tree.unflatten(opt_tree, opt_leaves)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return jax.tree.leaves(eqx.filter(model, eqx.is_array)), jax.tree.leaves(opt_state), loss

    return step, param_leaves, opt_leaves


def eqx_mlp(in_size: int = 32, out_size: int = 8, width: int = 64, depth: int = 2,
            batch: int | None = None):
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    kmodel, kx, ky = jax.random.split(jax.random.key(0), 3)
    model = eqx.nn.MLP(in_size=in_size, out_size=out_size, width_size=width, depth=depth,
                       key=kmodel)

    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    step, params, opt = _train_step(model, loss_fn, optax.adamw(1e-3, weight_decay=1e-2))
    x = jax.random.normal(kx, (batch or BATCH, in_size), jnp.float32)
    y = jax.random.normal(ky, (batch or BATCH, out_size), jnp.float32)
    return step, (params, opt, x, y)


def eqx_cnn():
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    class CNN(eqx.Module):
        layers: list

        def __init__(self, key):
            k1, k2, k3, k4 = jax.random.split(key, 4)
            self.layers = [
                eqx.nn.Conv2d(3, 8, kernel_size=3, padding=1, key=k1),
                jax.nn.relu,
                eqx.nn.MaxPool2d(kernel_size=2, stride=2),
                eqx.nn.Conv2d(8, 16, kernel_size=3, padding=1, key=k2),
                jax.nn.relu,
                jnp.ravel,
                eqx.nn.Linear(16 * 8 * 8, 64, key=k3),
                jax.nn.relu,
                eqx.nn.Linear(64, 8, key=k4),
            ]

        def __call__(self, x):  # x: (3, 16, 16), one image; vmap for a batch
            for layer in self.layers:
                x = layer(x)
            return x

    kmodel, kx, ky = jax.random.split(jax.random.key(0), 3)
    model = CNN(kmodel)

    def loss_fn(model, x, y):
        logits = jax.vmap(model)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    step, params, opt = _train_step(model, loss_fn, optax.adamw(1e-3, weight_decay=1e-2))
    x = jax.random.normal(kx, (BATCH, 3, 16, 16), jnp.float32)
    y = jax.random.randint(ky, (BATCH,), 0, 8, dtype=jnp.int32)
    return step, (params, opt, x, y)


MODELS = {"eqx_mlp": eqx_mlp, "eqx_cnn": eqx_cnn}

if __name__ == "__main__":
    sys.exit(_common.main(MODELS))
