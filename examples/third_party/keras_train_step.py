"""Keras 3 train steps (MLP, CNN with BatchNormalization, a Gemma-style decoder, a
Mixtral-style mixture of experts) on the JAX backend, exported for hloplan.

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


def _decoder_layers():
    """Keras layers of a Gemma-style decoder block and of a Mixtral-style sparse MoE block,
    written with keras.layers and keras.ops as a keras user writes them (keras-hub has such
    models, but it requires tensorflow-text, hence tensorflow, even on the JAX backend)."""
    import keras
    from keras import ops

    class GatedMLP(keras.layers.Layer):  # Gemma: GeGLU
        def __init__(self, hidden, **kwargs):
            super().__init__(**kwargs)
            self.hidden = hidden

        def build(self, shape):
            self.gate = keras.layers.Dense(self.hidden, use_bias=False)
            self.up = keras.layers.Dense(self.hidden, use_bias=False)
            self.down = keras.layers.Dense(shape[-1], use_bias=False)

        def call(self, x):
            return self.down(ops.gelu(self.gate(x), approximate=True) * self.up(x))

    class SparseMoE(keras.layers.Layer):  # Mixtral: top-2 of `experts` SwiGLU experts
        def __init__(self, experts, hidden, top_k=2, **kwargs):
            super().__init__(**kwargs)
            self.experts, self.hidden, self.top_k = experts, hidden, top_k

        def build(self, shape):
            d = shape[-1]
            self.router = keras.layers.Dense(self.experts, use_bias=False)
            init = keras.initializers.GlorotUniform()
            self.w_gate = self.add_weight((self.experts, d, self.hidden), init, name="w_gate")
            self.w_up = self.add_weight((self.experts, d, self.hidden), init, name="w_up")
            self.w_down = self.add_weight((self.experts, self.hidden, d), init, name="w_down")

        def call(self, x):
            logits = self.router(x)  # (batch, seq, experts)
            weights, chosen = ops.top_k(logits, self.top_k)
            weights = ops.softmax(weights, axis=-1)
            # Dense dispatch: every expert runs on every token, weighted by its routing weight
            # (zero for the experts a token was not routed to).
            combine = ops.sum(ops.one_hot(chosen, self.experts) * weights[..., None], axis=-2)
            gate = ops.einsum("bsd,edh->bseh", x, self.w_gate)
            up = ops.einsum("bsd,edh->bseh", x, self.w_up)
            out = ops.einsum("bseh,ehd->bsed", ops.silu(gate) * up, self.w_down)
            return ops.einsum("bsed,bse->bsd", out, combine)

    class Block(keras.layers.Layer):
        def __init__(self, heads, kv_heads, ffn, **kwargs):
            super().__init__(**kwargs)
            self.heads, self.kv_heads, self.ffn = heads, kv_heads, ffn

        def build(self, shape):
            d = shape[-1]
            self.norm1 = keras.layers.RMSNormalization()
            self.attn = keras.layers.GroupQueryAttention(d // self.heads, self.heads,
                                                         self.kv_heads, use_bias=False)
            self.norm2 = keras.layers.RMSNormalization()

        def call(self, x):
            h = self.norm1(x)
            x = x + self.attn(h, h, use_causal_mask=True)
            return x + self.ffn(self.norm2(x))

    return GatedMLP, SparseMoE, Block


def _decoder(name, vocab, seq, d, layers, heads, kv_heads, ffn_of, batch, seed=0):
    """A decoder LM: embedding scaled by sqrt(d) (Gemma), `layers` blocks, RMSNorm, logits
    through the tied embedding; the next-token loss."""
    import keras
    import numpy as np
    from keras import ops

    _, _, Block = _decoder_layers()

    class Decoder(keras.Model):
        def __init__(self):
            super().__init__(name=name)
            self.embedding = keras.layers.ReversibleEmbedding(vocab, d)
            self.blocks = [Block(heads, kv_heads, ffn_of()) for _ in range(layers)]
            self.norm = keras.layers.RMSNormalization()

        def call(self, tokens, training=False):
            x = self.embedding(tokens) * ops.sqrt(ops.cast(d, "float32"))
            for block in self.blocks:
                x = block(x)
            return self.embedding(self.norm(x), reverse=True)

    keras.utils.set_random_seed(seed)
    model = Decoder()
    model(np.zeros((1, seq), "int32"))  # creates the variables (each layer builds on first call)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step, state = _train_step(model, loss, keras.optimizers.AdamW(learning_rate=1e-3))
    rng = np.random.default_rng(seed + 1)
    tokens = rng.integers(0, vocab, (batch, seq + 1)).astype("int32")
    return step, (state, (tokens[:, :-1], tokens[:, 1:]))


def keras_gemma(size="tiny", batch=BATCH, seq=16, layers=4):
    """A Gemma-style decoder: GeGLU MLP, RMSNorm, grouped-query attention, tied embedding."""
    GatedMLP, _, _ = _decoder_layers()
    if size == "real":  # keras allocates the weights: 25M parameters a layer
        return _decoder("keras_gemma", 32000, seq, 1024, layers, 8, 1, lambda: GatedMLP(4096),
                        batch)
    return _decoder("keras_gemma", 128, seq, 32, 2, 4, 1, lambda: GatedMLP(64), batch)


def keras_moe(size="tiny", batch=BATCH, seq=16, layers=2):
    """A Mixtral-style decoder: top-2 routing (`keras.ops.top_k`, i.e. `jax.lax.top_k`) over 4
    SwiGLU experts, grouped-query attention."""
    _, SparseMoE, _ = _decoder_layers()
    if size == "real":  # 8 experts (keras allocates the weights)
        return _decoder("keras_moe", 32000, seq, 1024, layers, 16, 4,
                        lambda: SparseMoE(8, 2048), batch)
    return _decoder("keras_moe", 128, seq, 32, 2, 4, 2, lambda: SparseMoE(4, 32), batch)


MODELS = {"keras_mlp": keras_mlp, "keras_cnn": keras_cnn, "keras_gemma": keras_gemma,
          "keras_moe": keras_moe}

if __name__ == "__main__":
    sys.exit(_common.main(MODELS))
