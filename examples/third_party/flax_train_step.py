"""Flax train steps (nnx transformer, linen MLP) with optax AdamW, exported for hloplan.

    KERAS_BACKEND is irrelevant here; needs `pip install flax optax`.
    python examples/third_party/flax_train_step.py -o exports/            # write the .jaxexport files
    python examples/third_party/flax_train_step.py -o exports/ --check    # + plan and check on 8 CPU devices
    hloplan compile exports/nnx_transformer.jaxexport --mesh 2x4 -o plan/ && hloplan run plan/ --check

The step is the usual functional flax training step: `nnx.split` the model into a graphdef
and its parameters, `nnx.merge` inside the step (nnx docs, "functional API"), or
`model.apply(params, ...)` for linen.  Parameters cross the step boundary as a plain dict
(`nnx.to_pure_dict`, keys made strings) and the optax state as the flat list of its leaves, because
`Exported.serialize()` cannot serialize `nnx.State`/`nnx.Param` or optax's NamedTuples.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402  (sets XLA_FLAGS before jax is imported)

BATCH, SEQ, VOCAB, D_MODEL, HEADS, HIDDEN = 16, 16, 64, 32, 4, 64
# size="real": a GPT-2-medium-wide decoder (benchmarks/third_party.py's and benchmarks/tpu.py's).
REAL = {"VOCAB": 32768, "D_MODEL": 1024, "HEADS": 16, "HIDDEN": 4096}


def nnx_transformer(layers: int = 2, size: str = "tiny", batch: int | None = None,
                    seq: int | None = None):
    """A pre-LN decoder of nnx modules (tiny: random weights; size="real": the REAL widths,
    parameters and optimizer state only as shapes, nnx.eval_shape)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    widths = REAL if size == "real" else {"VOCAB": VOCAB, "D_MODEL": D_MODEL, "HEADS": HEADS,
                                          "HIDDEN": HIDDEN}
    batch, seq = batch or BATCH, seq or SEQ
    vocab, d_model, heads, hidden = (widths[k] for k in ("VOCAB", "D_MODEL", "HEADS", "HIDDEN"))

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
            # use_bias=False: the key bias gets an exactly-zero gradient (softmax ignores a shift
            # shared by all keys), so its float32 gradient is rounding noise that AdamW's first
            # step turns into +-lr: any reordering of sums (sharding included) changes it.
            self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d_model, decode=False,
                                               use_bias=False, rngs=rngs)
            self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
            self.up = nnx.Linear(d_model, hidden, rngs=rngs)
            self.down = nnx.Linear(hidden, d_model, rngs=rngs)

        def __call__(self, x, mask):
            x = x + self.attn(self.ln1(x), mask=mask)
            return x + self.down(nnx.gelu(self.up(self.ln2(x))))

    class Transformer(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
            self.pos = nnx.Param(jax.random.normal(rngs.params(), (seq, d_model)) * 0.02)
            self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
            self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
            self.head = nnx.Linear(d_model, vocab, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens) + self.pos[...]
            mask = nnx.make_causal_mask(tokens)
            for block in self.blocks:
                x = block(x, mask)
            return self.head(self.ln_f(x))

    model = (nnx.eval_shape(lambda: Transformer(nnx.Rngs(0))) if size == "real"
             else Transformer(nnx.Rngs(0)))
    graphdef, state = nnx.split(model, nnx.Param)
    # str_keys: nnx.List children are keyed 0, 1, ... and jax.export wants string keys.
    params = _common.str_keys(nnx.to_pure_dict(state))
    tx = optax.adamw(1e-3, weight_decay=1e-2)
    opt_state = jax.eval_shape(tx.init, params) if size == "real" else tx.init(params)
    opt_leaves, opt_tree = jax.tree.flatten(opt_state)

    def step(params, opt_leaves, tokens, labels):
        def loss_fn(params):
            logits = nnx.merge(graphdef, _common.int_keys(params))(tokens)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        opt_state = jax.tree.unflatten(opt_tree, opt_leaves)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), jax.tree.leaves(opt_state), loss

    key_t, key_l = jax.random.split(jax.random.key(1))
    tokens = jax.random.randint(key_t, (batch, seq), 0, vocab, dtype=jnp.int32)
    labels = jax.random.randint(key_l, (batch, seq), 0, vocab, dtype=jnp.int32)
    return step, (params, opt_leaves, tokens, labels)


def linen_mlp():
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(HIDDEN)(x))
            x = nn.LayerNorm()(x)
            x = nn.relu(nn.Dense(HIDDEN)(x))
            return nn.Dense(8)(x)

    model = MLP()
    key_p, key_x, key_y = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key_x, (32, D_MODEL), jnp.float32)
    y = jax.random.normal(key_y, (32, 8), jnp.float32)
    params = model.init(key_p, x)["params"]
    tx = optax.adamw(1e-3, weight_decay=1e-2)
    opt_leaves, opt_tree = jax.tree.flatten(tx.init(params))

    def step(params, opt_leaves, x, y):
        def loss_fn(params):
            return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, jax.tree.unflatten(opt_tree, opt_leaves), params)
        return optax.apply_updates(params, updates), jax.tree.leaves(opt_state), loss

    return step, (params, opt_leaves, x, y)


def linen_resnet(size: str = "tiny", batch: int = BATCH):
    """A linen ResNet (v2 pre-activation blocks) with GroupNorm, the normalisation of
    big_vision's BiT ResNets (it uses no batch statistics), global average pooling, softmax
    cross entropy."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    widths, image, classes = ((64, 128, 256, 512), 64, 1000) if size == "real" else \
        ((8, 16), 16, 10)

    class Block(nn.Module):
        width: int
        stride: int

        @nn.compact
        def __call__(self, x):
            h = nn.relu(nn.GroupNorm(num_groups=4)(x))
            skip = x
            if self.stride != 1 or x.shape[-1] != self.width:
                skip = nn.Conv(self.width, (1, 1), (self.stride, self.stride), use_bias=False)(h)
            h = nn.Conv(self.width, (3, 3), (self.stride, self.stride), use_bias=False)(h)
            h = nn.relu(nn.GroupNorm(num_groups=4)(h))
            return skip + nn.Conv(self.width, (3, 3), use_bias=False)(h)

    class ResNet(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(widths[0], (3, 3), use_bias=False)(x)
            for i, width in enumerate(widths):
                x = Block(width, 1 if i == 0 else 2)(x)
            x = nn.relu(nn.GroupNorm(num_groups=4)(x))
            return nn.Dense(classes)(x.mean(axis=(1, 2)))

    model = ResNet()
    key_p, key_x, key_y = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key_x, (batch, image, image, 3), jnp.float32)
    y = jax.random.randint(key_y, (batch,), 0, classes, jnp.int32)
    # At the real size only the shapes (the benchmark compiles, it never runs the step).
    init = jax.eval_shape if size == "real" else lambda f, *a: jax.jit(f)(*a)
    params = init(model.init, key_p, x)["params"]
    tx = optax.adamw(1e-3, weight_decay=1e-2)
    opt_leaves, opt_tree = jax.tree.flatten(init(tx.init, params))

    def step(params, opt_leaves, x, y):
        def loss_fn(params):
            logits = model.apply({"params": params}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, jax.tree.unflatten(opt_tree, opt_leaves), params)
        return optax.apply_updates(params, updates), jax.tree.leaves(opt_state), loss

    return step, (params, opt_leaves, x, y)


MODELS = {"nnx_transformer": nnx_transformer, "linen_mlp": linen_mlp,
          "linen_resnet": linen_resnet}

if __name__ == "__main__":
    sys.exit(_common.main(MODELS))
