"""Haiku train steps (a transformer built from hk.MultiHeadAttention, hk.nets.ResNet18 with
BatchNorm) with optax AdamW, exported for hloplan.

    pip install dm-haiku optax
    python examples/third_party/haiku_train_step.py -o exports/ --check

The step is haiku's usual one: `hk.transform` (`hk.transform_with_state` for BatchNorm's
moving averages), `jax.value_and_grad` of `apply`, optax's update.  Haiku's parameters are
dicts of dicts keyed by module path (serializable as they are); the optax state crosses the
step boundary as the flat list of its leaves.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402  (sets XLA_FLAGS before jax is imported)

BATCH = 16


def haiku_transformer(size: str = "tiny", batch: int = BATCH, seq: int = 16,
                      layers: int | None = None):
    """A pre-LN decoder (hk.Embed, hk.MultiHeadAttention with a causal mask, hk.LayerNorm,
    a GELU MLP), next-token cross entropy."""
    import haiku as hk
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    vocab, d, heads, depth = (32000, 1024, 16, 4) if size == "real" else (128, 32, 4, 2)
    layers = layers or depth

    def forward(tokens):
        x = hk.Embed(vocab, d)(tokens)
        x = x + hk.get_parameter("positions", (tokens.shape[1], d),
                                 init=hk.initializers.TruncatedNormal(0.02))
        mask = jnp.tril(jnp.ones((1, 1, tokens.shape[1], tokens.shape[1])))
        for _ in range(layers):
            h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
            # with_bias=False: the key bias gets an exactly-zero gradient (softmax ignores a
            # shift shared by all keys), rounding noise that AdamW's first step turns into
            # +-lr, and any reordering of sums (sharding included) changes it.
            attention = hk.MultiHeadAttention(heads, d // heads,
                                              w_init=hk.initializers.VarianceScaling(1.0),
                                              with_bias=False)
            x = x + attention(h, h, h, mask=mask)
            h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
            x = x + hk.nets.MLP([4 * d, d], activation=jax.nn.gelu)(h)
        return hk.Linear(vocab)(hk.LayerNorm(-1, create_scale=True, create_offset=True)(x))

    model = hk.without_apply_rng(hk.transform(forward))
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, vocab, (batch, seq + 1)).astype("int32")
    # At the real size only the shapes (the benchmark compiles, it never runs the step).
    init = jax.eval_shape if size == "real" else lambda f, *a: jax.jit(f)(*a)
    params = init(model.init, jax.random.key(0), tokens[:, :-1])
    tx = optax.adamw(1e-3, weight_decay=1e-2)
    opt_leaves, opt_tree = jax.tree.flatten(init(tx.init, params))

    def step(params, opt_leaves, inputs, targets):
        def loss_fn(params):
            logits = model.apply(params, inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, jax.tree.unflatten(opt_tree, opt_leaves), params)
        return optax.apply_updates(params, updates), jax.tree.leaves(opt_state), loss

    return step, (params, opt_leaves, tokens[:, :-1], tokens[:, 1:])


def haiku_resnet(size: str = "tiny", batch: int = BATCH):
    """hk.nets.ResNet in ResNet18's layout, BatchNorm with moving averages
    (hk.transform_with_state); the step takes and returns the BatchNorm state beside the
    parameters."""
    import haiku as hk
    import jax
    import numpy as np
    import optax

    image, classes, widths = (224, 1000, (64, 128, 256, 512)) if size == "real" else \
        (16, 10, (8, 8, 16, 16))

    def forward(x, is_training):
        # ResNet18's layout (2 basic blocks per group), its widths smaller when tiny.
        net = hk.nets.ResNet((2, 2, 2, 2), classes, resnet_v2=True, bottleneck=False,
                             channels_per_group=widths,
                             initial_conv_config={"output_channels": widths[0]})
        return net(x, is_training=is_training)

    model = hk.without_apply_rng(hk.transform_with_state(forward))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, image, image, 3)).astype("float32")
    y = rng.integers(0, classes, (batch,)).astype("int32")
    params, state = jax.jit(model.init, static_argnums=2)(jax.random.key(0), x, True)
    tx = optax.adamw(1e-3, weight_decay=1e-2)
    opt_leaves, opt_tree = jax.tree.flatten(tx.init(params))

    def step(train_state, data):
        params, state, opt_leaves = train_state
        x, y = data

        def loss_fn(params):
            logits, new_state = model.apply(params, state, x, True)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new_state

        (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, jax.tree.unflatten(opt_tree, opt_leaves), params)
        return loss, (optax.apply_updates(params, updates), state, jax.tree.leaves(opt_state))

    return step, ((params, state, opt_leaves), (x, y))


MODELS = {"haiku_transformer": haiku_transformer, "haiku_resnet": haiku_resnet}

if __name__ == "__main__":
    sys.exit(_common.main(MODELS))
