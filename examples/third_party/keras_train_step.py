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


def keras_mlp(in_size=32, width=64, out_size=8, depth=2, batch=BATCH):
    """`depth` hidden Dense+ReLU layers of `width`, then a linear Dense to `out_size`."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((in_size,))]
        + [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        + [keras.layers.Dense(out_size)])
    step, state = _train_step(model, keras.losses.MeanSquaredError(),
                              keras.optimizers.AdamW(learning_rate=1e-3))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, in_size)).astype("float32")
    y = rng.standard_normal((batch, out_size)).astype("float32")
    return step, (state, (x, y))


def keras_cnn(image=16, channels=(8, 16), classes=8, batch=BATCH, convs_per_stage=1):
    """One stage per entry of `channels`: `convs_per_stage` times (3x3 Conv2D,
    BatchNormalization, ReLU), a 2x2 max-pool between stages; then global average pooling and
    a Dense classifier."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    layers = [keras.Input((image, image, 3))]
    for i, width in enumerate(channels):
        if i:
            layers.append(keras.layers.MaxPooling2D(2))
        for _ in range(convs_per_stage):
            # No bias before batch norm (it cancels): its gradient is rounding noise, which
            # AdamW would turn into steps of the learning rate.
            layers += [keras.layers.Conv2D(width, 3, padding="same", use_bias=False),
                       keras.layers.BatchNormalization(), keras.layers.ReLU()]
    layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(classes)]
    model = keras.Sequential(layers)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step, state = _train_step(model, loss, keras.optimizers.AdamW(learning_rate=1e-3))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, image, image, 3)).astype("float32")
    y = rng.integers(0, classes, (batch,)).astype("int32")
    return step, (state, (x, y))


MODELS = {"keras_mlp": keras_mlp, "keras_cnn": keras_cnn}

if __name__ == "__main__":
    sys.exit(_common.main(MODELS))
