"""Keras 3 train steps (MLP, CNN with BatchNormalization) on the JAX backend, exported for hloplan.

    pip install keras            # no tensorflow needed: KERAS_BACKEND=jax
    KERAS_BACKEND=jax python examples/third_party/keras_train_step.py -o exports/ --check
    hloplan compile exports/keras_cnn.jaxexport --mesh 2x4 -o plan/ && hloplan run plan/ --check

The step is the stateless train step from the keras guide "Writing a training loop from scratch
in JAX": `model.stateless_call(trainable, non_trainable, x, training=True)` and
`optimizer.stateless_apply(optimizer_variables, grads, trainable)`.  The state is a tuple of
lists of arrays, which `Exported.serialize()` handles as is.
"""

from __future__ import annotations

import os
import sys

# Keras reads its backend once, at import; this script needs the JAX one.
os.environ["KERAS_BACKEND"] = "jax"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402  (sets XLA_FLAGS before jax is imported)

BATCH = 16


def _train_step(model, loss_fn, optimizer):
    import jax

    optimizer.build(model.trainable_variables)

    def compute_loss_and_updates(trainable, non_trainable, x, y):
        y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return loss_fn(y, y_pred), non_trainable

    grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

    def step(state, data):
        trainable, non_trainable, optimizer_variables = state
        x, y = data
        (loss, non_trainable), grads = grad_fn(trainable, non_trainable, x, y)
        trainable, optimizer_variables = optimizer.stateless_apply(optimizer_variables, grads,
                                                                   trainable)
        return loss, (trainable, non_trainable, optimizer_variables)

    state = ([v.value for v in model.trainable_variables],
             [v.value for v in model.non_trainable_variables],
             [v.value for v in optimizer.variables])
    return step, state


def keras_mlp():
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((32,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(8),
    ])
    step, state = _train_step(model, keras.losses.MeanSquaredError(),
                              keras.optimizers.AdamW(learning_rate=1e-3))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, 32)).astype("float32")
    y = rng.standard_normal((BATCH, 8)).astype("float32")
    return step, (state, (x, y))


def keras_cnn():
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.Conv2D(8, 3, padding="same"),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(8),
    ])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step, state = _train_step(model, loss, keras.optimizers.AdamW(learning_rate=1e-3))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 8, (BATCH,)).astype("int32")
    return step, (state, (x, y))


MODELS = {"keras_mlp": keras_mlp, "keras_cnn": keras_cnn}

if __name__ == "__main__":
    sys.exit(_common.main(MODELS))
