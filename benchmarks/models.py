"""Benchmark programs: one training step (loss, gradients, optimizer update) per model.

Plain JAX, hand-written optimizers. Every model is described by a `Model`:

* `state_spec(cfg)` / `batch_spec(cfg)`: pytrees of `Leaf` (shape, dtype, logical axis names);
  `abstract(...)` turns them into `jax.ShapeDtypeStruct`s (no memory needed for big sizes),
  `concrete(...)` into arrays for the small numerics check;
* `step(state, batch) -> (loss, new_state)`: the single-device program.

Logical axis names ("batch", "embed", "heads", "mlp", "vocab", "experts", ...) annotate the
parameters, and `constrain(x, *names)` annotates a few activations (block boundaries, attention
heads, MLP hidden). Without `logical_rules(...)` active, `constrain` is the identity, so the
program exported for hloplan carries no sharding at all; hand_plans.py maps the names onto mesh
axes (the Flax "logical partitioning" pattern) to write the expert plans.

Sizes: "small" for the numerics check (runs on CPU in seconds), "realistic" for plan
comparison (thousands of tokens per device, hidden 1024-2048); the realistic global batch is
scaled with the number of devices so each device sees the same work whatever the mesh.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# ---------------------------------------------------------------------------------------------
# Leaves, logical axes and activation constraints


@dataclass(frozen=True)
class Leaf:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    dtype: Any = jnp.float32
    init: str = "normal"  # normal | zeros | ones | tokens | labels | mask
    scale: float = 0.02
    high: int = 2  # exclusive upper bound of integer leaves

    def __post_init__(self):
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)


def is_leaf(x) -> bool:
    return isinstance(x, Leaf)


def abstract(tree):
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), tree,
                        is_leaf=is_leaf)


def axes_of(tree):
    return jax.tree.map(lambda leaf: leaf.axes, tree, is_leaf=is_leaf)


def concrete(tree, seed: int = 0):
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_leaf)
    rng = np.random.default_rng(seed)
    out = []
    for leaf in leaves:
        if leaf.init == "zeros":
            value = np.zeros(leaf.shape)
        elif leaf.init == "ones":
            value = np.ones(leaf.shape)
        elif leaf.init in ("tokens", "labels"):
            value = rng.integers(0, leaf.high, size=leaf.shape)
        elif leaf.init == "mask":
            value = rng.random(leaf.shape) < 0.15
        else:
            value = rng.standard_normal(leaf.shape) * leaf.scale
        out.append(jnp.asarray(value, dtype=leaf.dtype))
    return jax.tree.unflatten(treedef, out)


_RULES: dict | None = None  # {"mesh": Mesh, "rules": {logical name: mesh axes or None}}


@contextlib.contextmanager
def logical_rules(mesh, rules: dict):
    """While active, `constrain` pins activations to the mesh axes `rules` maps their names to."""
    global _RULES
    saved, _RULES = _RULES, {"mesh": mesh, "rules": rules}
    try:
        yield
    finally:
        _RULES = saved


def logical_spec(names, rules: dict, shape=None, mesh_shape=None):
    """PartitionSpec of a tensor whose dims have logical `names`; a mesh axis is used at most once
    and only on a dim it divides."""
    from jax.sharding import PartitionSpec

    used: set[str] = set()
    entries = []
    for d, name in enumerate(names):
        axes = rules.get(name) if name is not None else None
        if axes is None:
            entries.append(None)
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        axes = tuple(a for a in axes if a not in used)
        if shape is not None and mesh_shape is not None:
            kept = []
            for a in axes:
                if shape[d] % (math.prod(mesh_shape[k] for k in kept) * mesh_shape[a]) == 0:
                    kept.append(a)
            axes = tuple(kept)
        used.update(axes)
        entries.append(axes if len(axes) > 1 else (axes[0] if axes else None))
    return PartitionSpec(*entries)


def constrain(x, *names):
    if _RULES is None:
        return x
    from jax.sharding import NamedSharding

    mesh = _RULES["mesh"]
    spec = logical_spec(names, _RULES["rules"], x.shape, dict(mesh.shape))
    return lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# ---------------------------------------------------------------------------------------------
# Optimizers


def adamw_state_spec(params):
    zeros = jax.tree.map(lambda p: Leaf(p.shape, p.axes, p.dtype, "zeros"), params, is_leaf=is_leaf)
    return {"m": zeros, "v": zeros, "count": Leaf((), (), jnp.int32, "zeros")}


def adamw(params, grads, opt, lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, wd=0.01):
    count = opt["count"] + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, opt["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, opt["v"], grads)
    t = count.astype(jnp.float32)
    c1, c2 = 1 - b1**t, 1 - b2**t

    def update(p, m, v):
        return p - lr * ((m / c1) / (jnp.sqrt(v / c2) + eps) + wd * p)

    return jax.tree.map(update, params, m, v), {"m": m, "v": v, "count": count}


def momentum_state_spec(params):
    return jax.tree.map(lambda p: Leaf(p.shape, p.axes, p.dtype, "zeros"), params, is_leaf=is_leaf)


def sgd_momentum(params, grads, mom, lr=0.1, beta=0.9, wd=1e-4):
    mom = jax.tree.map(lambda m, g, p: beta * m + g + wd * p, mom, grads, params)
    return jax.tree.map(lambda p, m: p - lr * m, params, mom), mom


def _dense(n_in, n_out, axes):
    return Leaf((n_in, n_out), axes, scale=1.0 / math.sqrt(n_in))


def _vec(n, axis, init="zeros"):
    return Leaf((n,), (axis,), init=init)


# ---------------------------------------------------------------------------------------------
# Shared transformer pieces


def layer_norm(x, p, eps=1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def rms_norm(x, scale, eps=1e-6):
    return x * lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps) * scale


def _ln_spec(d):
    return {"scale": _vec(d, "embed", "ones"), "bias": _vec(d, "embed")}


def cross_entropy(logits, targets, weights=None, one_hot: bool = True):
    """Mean token negative log-likelihood. The label is picked with a one-hot contraction (as
    optax/MaxText do); `one_hot=False` uses take_along_axis (gather/scatter in the gradient)."""
    logits = constrain(logits, "batch", "seq", "vocab")
    logp = jax.nn.log_softmax(logits, axis=-1)
    if one_hot:
        labels = jax.nn.one_hot(targets, logits.shape[-1], dtype=logp.dtype)
        nll = -jnp.sum(constrain(labels, "batch", "seq", "vocab") * logp, axis=-1)
    else:
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    if weights is None:
        return jnp.mean(nll)
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def attention(q, k, v, causal: bool):
    """q [b, t, h, hd], k/v [b, t, h, hd] (same head count) -> [b, t, h, hd]."""
    hd = q.shape[-1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(hd))
    scores = constrain(scores, "batch", "heads", None, None)
    if causal:
        t = q.shape[1]
        mask = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


# ---------------------------------------------------------------------------------------------
# GPT-2-like decoder (pre-LN, learned positions, GELU MLP, untied head, AdamW)


def gpt_config(size: str, devices: int = 8, layers: int | None = None, hidden: int | None = None,
               heads: int | None = None, batch: int | None = None, seq: int | None = None):
    if size == "small":
        cfg = dict(vocab=128, seq=16, d=64, heads=8, layers=2, batch=max(16, devices))
    else:
        cfg = dict(vocab=50304, seq=1024, d=1536, heads=16, layers=2, batch=8 * devices)
    for key, value in (("layers", layers), ("d", hidden), ("heads", heads), ("batch", batch),
                       ("seq", seq)):
        if value is not None:
            cfg[key] = value
    return cfg


def gpt_param_spec(c):
    d, f = c["d"], 4 * c["d"]
    layer = {
        "ln1": _ln_spec(d),
        "w_qkv": Leaf((d, 3, c["heads"], d // c["heads"]), ("embed", None, "heads", "head_dim"),
                      scale=1.0 / math.sqrt(d)),
        "b_qkv": Leaf((3, c["heads"], d // c["heads"]), (None, "heads", "head_dim"), init="zeros"),
        "w_o": Leaf((c["heads"], d // c["heads"], d), ("heads", "head_dim", "embed"),
                    scale=1.0 / math.sqrt(d)),
        "b_o": _vec(d, "embed"),
        "ln2": _ln_spec(d),
        "w_fc": _dense(d, f, ("embed", "mlp")),
        "b_fc": _vec(f, "mlp"),
        "w_out": _dense(f, d, ("mlp", "embed")),
        "b_out": _vec(d, "embed"),
    }
    return {
        "wte": Leaf((c["vocab"], d), ("vocab", "embed")),
        "wpe": Leaf((c["seq"], d), (None, "embed")),
        "layers": [layer for _ in range(c["layers"])],
        "ln_f": _ln_spec(d),
        "w_head": _dense(d, c["vocab"], ("embed", "vocab")),
    }


def gpt_state_spec(c):
    params = gpt_param_spec(c)
    return {"params": params, "opt": adamw_state_spec(params)}


def lm_batch_spec(c):
    return {"tokens": Leaf((c["batch"], c["seq"]), ("batch", "seq"), jnp.int32, "tokens",
                           high=c["vocab"]),
            "targets": Leaf((c["batch"], c["seq"]), ("batch", "seq"), jnp.int32, "labels",
                            high=c["vocab"])}


def _gpt_block(x, p):
    x = constrain(x, "batch", "seq", "embed")
    h = layer_norm(x, p["ln1"])
    qkv = jnp.einsum("btd,dshk->sbthk", h, p["w_qkv"]) + p["b_qkv"][:, None, None]
    qkv = constrain(qkv, None, "batch", "seq", "heads", None)
    out = attention(qkv[0], qkv[1], qkv[2], causal=True)
    x = x + jnp.einsum("bthk,hkd->btd", out, p["w_o"]) + p["b_o"]
    x = constrain(x, "batch", "seq", "embed")
    h = layer_norm(x, p["ln2"])
    h = jax.nn.gelu(h @ p["w_fc"] + p["b_fc"])
    h = constrain(h, "batch", "seq", "mlp")
    return x + h @ p["w_out"] + p["b_out"]


def gpt_loss(params, batch, remat: bool = False):
    tokens = batch["tokens"]
    x = params["wte"][tokens] + params["wpe"][: tokens.shape[1]]
    block = jax.checkpoint(_gpt_block) if remat else _gpt_block
    for layer in params["layers"]:
        x = block(x, layer)
    x = layer_norm(constrain(x, "batch", "seq", "embed"), params["ln_f"])
    return cross_entropy(x @ params["w_head"], batch["targets"])


def gpt_step(state, batch, remat: bool = False):
    """One AdamW step; `remat`: recompute each block's activations in the backward pass
    (jax.checkpoint per layer, as Alpa's GPT benchmark does)."""
    loss, grads = jax.value_and_grad(gpt_loss)(state["params"], batch, remat)
    params, opt = adamw(state["params"], grads, state["opt"])
    return loss, {"params": params, "opt": opt}


# ---------------------------------------------------------------------------------------------
# Llama-like decoder (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention, AdamW)


def llama_config(size: str, devices: int = 8):
    if size == "small":
        return dict(vocab=128, seq=16, d=64, heads=8, kv_heads=4, ffn=128, layers=2,
                    batch=max(16, devices))
    return dict(vocab=32000, seq=1024, d=2048, heads=16, kv_heads=8, ffn=5632, layers=2,
                batch=8 * devices)


def llama_state_spec(c):
    d, hd = c["d"], c["d"] // c["heads"]
    layer = {
        "attn_norm": _vec(d, "embed", "ones"),
        "wq": Leaf((d, c["heads"], hd), ("embed", "heads", "head_dim"), scale=1 / math.sqrt(d)),
        "wk": Leaf((d, c["kv_heads"], hd), ("embed", "kv_heads", "head_dim"),
                   scale=1 / math.sqrt(d)),
        "wv": Leaf((d, c["kv_heads"], hd), ("embed", "kv_heads", "head_dim"),
                   scale=1 / math.sqrt(d)),
        "wo": Leaf((c["heads"], hd, d), ("heads", "head_dim", "embed"), scale=1 / math.sqrt(d)),
        "mlp_norm": _vec(d, "embed", "ones"),
        "w_gate": _dense(d, c["ffn"], ("embed", "mlp")),
        "w_up": _dense(d, c["ffn"], ("embed", "mlp")),
        "w_down": _dense(c["ffn"], d, ("mlp", "embed")),
    }
    params = {"embed": Leaf((c["vocab"], d), ("vocab", "embed")),
              "layers": [layer for _ in range(c["layers"])],
              "norm": _vec(d, "embed", "ones"),
              "head": _dense(d, c["vocab"], ("embed", "vocab"))}
    return {"params": params, "opt": adamw_state_spec(params)}


def rotary(x, positions, base=10000.0):
    """x [b, t, h, hd]: rotate pairs (first half, second half) by position-dependent angles."""
    hd = x.shape[-1]
    freqs = base ** (-jnp.arange(0, hd // 2, dtype=jnp.float32) * 2 / hd)
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]  # [t, hd/2]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _llama_block(x, p, c):
    x = constrain(x, "batch", "seq", "embed")
    positions = jnp.arange(x.shape[1])
    h = rms_norm(x, p["attn_norm"])
    q = rotary(jnp.einsum("btd,dhk->bthk", h, p["wq"]), positions)
    k = rotary(jnp.einsum("btd,dhk->bthk", h, p["wk"]), positions)
    v = jnp.einsum("btd,dhk->bthk", h, p["wv"])
    q = constrain(q, "batch", "seq", "heads", None)
    k = constrain(k, "batch", "seq", "kv_heads", None)
    v = constrain(v, "batch", "seq", "kv_heads", None)
    rep = c["heads"] // c["kv_heads"]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)  # grouped-query attention
    out = attention(q, k, v, causal=True)
    x = x + jnp.einsum("bthk,hkd->btd", out, p["wo"])
    x = constrain(x, "batch", "seq", "embed")
    h = rms_norm(x, p["mlp_norm"])
    g = constrain(jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"]), "batch", "seq", "mlp")
    return x + g @ p["w_down"]


def llama_step(state, batch, c):
    def loss_fn(params):
        x = params["embed"][batch["tokens"]]
        for layer in params["layers"]:
            x = _llama_block(x, layer, c)
        x = rms_norm(constrain(x, "batch", "seq", "embed"), params["norm"])
        return cross_entropy(x @ params["head"], batch["targets"])

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    params, opt = adamw(state["params"], grads, state["opt"])
    return loss, {"params": params, "opt": opt}


# ---------------------------------------------------------------------------------------------
# BERT-like encoder (post-LN, bidirectional attention, masked-LM loss on masked positions)


def bert_config(size: str, devices: int = 8):
    if size == "small":
        return dict(vocab=128, seq=16, d=64, heads=8, layers=2, batch=max(16, devices))
    return dict(vocab=30720, seq=512, d=1024, heads=16, layers=2, batch=16 * devices)


def bert_state_spec(c):
    d, f, hd = c["d"], 4 * c["d"], c["d"] // c["heads"]
    layer = {
        "wq": Leaf((d, c["heads"], hd), ("embed", "heads", "head_dim"), scale=1 / math.sqrt(d)),
        "wk": Leaf((d, c["heads"], hd), ("embed", "heads", "head_dim"), scale=1 / math.sqrt(d)),
        "wv": Leaf((d, c["heads"], hd), ("embed", "heads", "head_dim"), scale=1 / math.sqrt(d)),
        "wo": Leaf((c["heads"], hd, d), ("heads", "head_dim", "embed"), scale=1 / math.sqrt(d)),
        "ln1": _ln_spec(d),
        "w_in": _dense(d, f, ("embed", "mlp")),
        "b_in": _vec(f, "mlp"),
        "w_out": _dense(f, d, ("mlp", "embed")),
        "b_out": _vec(d, "embed"),
        "ln2": _ln_spec(d),
    }
    params = {"word": Leaf((c["vocab"], d), ("vocab", "embed")),
              "pos": Leaf((c["seq"], d), (None, "embed")),
              "ln_emb": _ln_spec(d),
              "layers": [layer for _ in range(c["layers"])],
              "w_mlm": _dense(d, d, ("embed", "embed2")),
              "ln_mlm": {"scale": _vec(d, "embed2", "ones"), "bias": _vec(d, "embed2")},
              "w_dec": _dense(d, c["vocab"], ("embed2", "vocab"))}
    return {"params": params, "opt": adamw_state_spec(params)}


def bert_batch_spec(c):
    spec = lm_batch_spec(c)
    spec["weights"] = Leaf((c["batch"], c["seq"]), ("batch", "seq"), jnp.float32, "mask")
    return spec


def _bert_block(x, p):
    x = constrain(x, "batch", "seq", "embed")
    q = jnp.einsum("btd,dhk->bthk", x, p["wq"])
    k = jnp.einsum("btd,dhk->bthk", x, p["wk"])
    v = jnp.einsum("btd,dhk->bthk", x, p["wv"])
    q = constrain(q, "batch", "seq", "heads", None)
    out = attention(q, k, v, causal=False)
    x = layer_norm(x + jnp.einsum("bthk,hkd->btd", out, p["wo"]), p["ln1"])
    x = constrain(x, "batch", "seq", "embed")
    h = constrain(jax.nn.gelu(x @ p["w_in"] + p["b_in"]), "batch", "seq", "mlp")
    return layer_norm(x + h @ p["w_out"] + p["b_out"], p["ln2"])


def bert_step(state, batch):
    def loss_fn(params):
        tokens = batch["tokens"]
        x = params["word"][tokens] + params["pos"][: tokens.shape[1]]
        x = layer_norm(x, params["ln_emb"])
        for layer in params["layers"]:
            x = _bert_block(x, layer)
        x = constrain(x, "batch", "seq", "embed")
        h = layer_norm(jax.nn.gelu(x @ params["w_mlm"]), params["ln_mlm"])
        return cross_entropy(h @ params["w_dec"], batch["targets"], batch["weights"])

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    params, opt = adamw(state["params"], grads, state["opt"])
    return loss, {"params": params, "opt": opt}


# ---------------------------------------------------------------------------------------------
# Mixture of experts: top-2 routing, GShard-style einsum dispatch/combine with capacity


def moe_config(size: str, devices: int = 8):
    if size == "small":
        return dict(d=64, ffn=128, experts=8, layers=2, batch=max(16, devices), seq=16,
                    capacity_factor=2.0)
    return dict(d=1024, ffn=4096, experts=8, layers=2, batch=8 * devices, seq=1024,
                capacity_factor=1.25)


def moe_state_spec(c):
    d, f, e = c["d"], c["ffn"], c["experts"]
    layer = {
        "norm": _vec(d, "embed", "ones"),
        "router": Leaf((d, e), ("embed", None), scale=1 / math.sqrt(d)),
        "w_in": Leaf((e, d, f), ("experts", "embed", "mlp"), scale=1 / math.sqrt(d)),
        "w_out": Leaf((e, f, d), ("experts", "mlp", "embed"), scale=1 / math.sqrt(f)),
    }
    params = {"w_emb": _dense(d, d, ("embed2", "embed")), "layers": [layer for _ in range(c["layers"])],
              "w_head": _dense(d, d, ("embed", "embed2"))}
    return {"params": params, "opt": adamw_state_spec(params)}


def moe_batch_spec(c):
    shape = (c["batch"], c["seq"], c["d"])
    return {"x": Leaf(shape, ("batch", "seq", None), scale=1.0),
            "y": Leaf(shape, ("batch", "seq", None), scale=1.0)}


def top2_dispatch(logits, capacity):
    """logits [g, s, e] -> dispatch mask [g, s, e, c] (0/1), combine weights [g, s, e, c],
    and the load-balancing loss (GShard, one group per sequence)."""
    e = logits.shape[-1]
    gates = jax.nn.softmax(logits, axis=-1)
    index1 = jnp.argmax(gates, axis=-1)
    mask1 = jax.nn.one_hot(index1, e, dtype=gates.dtype)
    gates_wo1 = gates * (1.0 - mask1)
    index2 = jnp.argmax(gates_wo1, axis=-1)
    mask2 = jax.nn.one_hot(index2, e, dtype=gates.dtype)
    aux = jnp.mean(jnp.mean(gates, axis=1) * jnp.mean(mask1, axis=1)) * e * e
    pos1 = jnp.cumsum(mask1, axis=1) - mask1  # position in the expert's buffer
    mask1 = mask1 * (pos1 < capacity)
    count1 = jnp.sum(mask1, axis=1, keepdims=True)
    pos2 = jnp.cumsum(mask2, axis=1) - mask2 + count1
    mask2 = mask2 * (pos2 < capacity)
    g1 = jnp.sum(gates * mask1, axis=-1)
    g2 = jnp.sum(gates * mask2, axis=-1)
    denom = jnp.maximum(g1 + g2, 1e-9)
    g1, g2 = g1 / denom, g2 / denom
    slot1 = jax.nn.one_hot(jnp.sum(pos1 * mask1, axis=-1).astype(jnp.int32), capacity,
                           dtype=gates.dtype)
    slot2 = jax.nn.one_hot(jnp.sum(pos2 * mask2, axis=-1).astype(jnp.int32), capacity,
                           dtype=gates.dtype)
    combine = (g1[..., None, None] * mask1[..., None] * slot1[:, :, None, :]
               + g2[..., None, None] * mask2[..., None] * slot2[:, :, None, :])
    dispatch = (combine > 0).astype(gates.dtype)
    return dispatch, combine, aux


def _moe_layer(x, p, c):
    x = constrain(x, "batch", "seq", "embed")
    h = rms_norm(x, p["norm"])
    capacity = int(math.ceil(2 * x.shape[1] / c["experts"] * c["capacity_factor"]))
    dispatch, combine, aux = top2_dispatch(h @ p["router"], capacity)
    expert_in = jnp.einsum("gsec,gsd->egcd", dispatch, h)
    expert_in = constrain(expert_in, "experts", "batch", None, "embed")
    hidden = jax.nn.gelu(jnp.einsum("egcd,edf->egcf", expert_in, p["w_in"]))
    hidden = constrain(hidden, "experts", "batch", None, "mlp")
    expert_out = jnp.einsum("egcf,efd->egcd", hidden, p["w_out"])
    expert_out = constrain(expert_out, "experts", "batch", None, "embed")
    return x + jnp.einsum("gsec,egcd->gsd", combine, expert_out), aux


def moe_step(state, batch, c):
    def loss_fn(params):
        x = batch["x"] @ params["w_emb"]
        aux_total = 0.0
        for layer in params["layers"]:
            x, aux = _moe_layer(x, layer, c)
            aux_total = aux_total + aux
        pred = constrain(x, "batch", "seq", "embed") @ params["w_head"]
        return jnp.mean(jnp.square(pred - batch["y"])) + 0.01 * aux_total

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    params, opt = adamw(state["params"], grads, state["opt"])
    return loss, {"params": params, "opt": opt}


# ---------------------------------------------------------------------------------------------
# ResNet-like conv net (NHWC, basic blocks, batch norm in training mode, SGD with momentum)


def resnet_config(size: str, devices: int = 8):
    if size == "small":
        return dict(image=16, channels=(16, 32), blocks=1, classes=16, batch=max(16, devices))
    return dict(image=128, channels=(128, 256, 512), blocks=2, classes=1024, batch=32 * devices)


def _conv_spec(k, cin, cout, axes_in, axes_out):
    return Leaf((k, k, cin, cout), (None, None, axes_in, axes_out),
                scale=math.sqrt(2.0 / (k * k * cin)))


def resnet_state_spec(c):
    chans = c["channels"]
    params = {"stem": _conv_spec(3, 3, chans[0], None, "channels"),
              "stem_bn": {"scale": _vec(chans[0], "channels", "ones"),
                          "bias": _vec(chans[0], "channels")}}
    stats = {"stem_bn": {"mean": _vec(chans[0], "channels"),
                         "var": _vec(chans[0], "channels", "ones")}}
    blocks, block_stats = [], []
    cin = chans[0]
    for stage, cout in enumerate(chans):
        for b in range(c["blocks"]):
            blk = {"conv1": _conv_spec(3, cin, cout, "channels", "channels_hidden"),
                   "bn1": {"scale": _vec(cout, "channels_hidden", "ones"),
                           "bias": _vec(cout, "channels_hidden")},
                   "conv2": _conv_spec(3, cout, cout, "channels_hidden", "channels"),
                   "bn2": {"scale": _vec(cout, "channels", "ones"), "bias": _vec(cout, "channels")}}
            st = {"bn1": {"mean": _vec(cout, "channels_hidden"),
                          "var": _vec(cout, "channels_hidden", "ones")},
                  "bn2": {"mean": _vec(cout, "channels"), "var": _vec(cout, "channels", "ones")}}
            if b == 0 and (stage > 0 or cin != cout):
                blk["proj"] = _conv_spec(1, cin, cout, "channels", "channels_proj")
            blocks.append(blk)
            block_stats.append(st)
            cin = cout
    params["blocks"] = blocks
    params["fc"] = _dense(cin, c["classes"], ("channels", "classes"))
    params["fc_b"] = _vec(c["classes"], "classes")
    stats["blocks"] = block_stats
    return {"params": params, "stats": stats, "opt": momentum_state_spec(params)}


def resnet_batch_spec(c):
    return {"images": Leaf((c["batch"], c["image"], c["image"], 3), ("batch", None, None, None),
                           scale=1.0),
            "labels": Leaf((c["batch"],), ("batch",), jnp.int32, "labels", high=c["classes"])}


def _conv(x, w, stride=1):
    return lax.conv_general_dilated(x, w, (stride, stride), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _batch_norm(x, p, st, momentum=0.9, eps=1e-5):
    mean = jnp.mean(x, axis=(0, 1, 2))
    var = jnp.mean(jnp.square(x - mean), axis=(0, 1, 2))
    y = (x - mean) * lax.rsqrt(var + eps) * p["scale"] + p["bias"]
    new = {"mean": momentum * st["mean"] + (1 - momentum) * mean,
           "var": momentum * st["var"] + (1 - momentum) * var}
    return y, new


def resnet_step(state, batch, c):
    def loss_fn(params):
        x = constrain(batch["images"], "batch", None, None, None)
        x, s = _batch_norm(_conv(x, params["stem"]), params["stem_bn"], state["stats"]["stem_bn"])
        x = jax.nn.relu(x)
        stats = {"stem_bn": s, "blocks": []}
        for i, (blk, st) in enumerate(zip(params["blocks"], state["stats"]["blocks"])):
            stride = 2 if "proj" in blk and i > 0 else 1
            x = constrain(x, "batch", None, None, "channels")
            h, s1 = _batch_norm(_conv(x, blk["conv1"], stride), blk["bn1"], st["bn1"])
            h = constrain(jax.nn.relu(h), "batch", None, None, "channels_hidden")
            h, s2 = _batch_norm(_conv(h, blk["conv2"]), blk["bn2"], st["bn2"])
            shortcut = _conv(x, blk["proj"], stride) if "proj" in blk else x
            x = jax.nn.relu(h + shortcut)
            stats["blocks"].append({"bn1": s1, "bn2": s2})
        feats = jnp.mean(x, axis=(1, 2))
        logits = feats @ params["fc"] + params["fc_b"]
        logp = jax.nn.log_softmax(logits)
        loss = -jnp.mean(jnp.take_along_axis(logp, batch["labels"][:, None], axis=-1))
        return loss, stats

    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    params, opt = sgd_momentum(state["params"], grads, state["opt"])
    return loss, {"params": params, "stats": stats, "opt": opt}


# ---------------------------------------------------------------------------------------------
# MLP (GELU hidden layers, MSE loss, AdamW)


def mlp_config(size: str, devices: int = 8):
    if size == "small":
        return dict(sizes=(32, 64, 64, 16), batch=max(32, devices))
    return dict(sizes=(2048, 8192, 8192, 2048), batch=4096 * devices)


def mlp_state_spec(c):
    sizes = c["sizes"]
    layers = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        a_in, a_out = ("embed", "mlp") if i % 2 == 0 else ("mlp", "embed")
        layers.append({"w": _dense(n_in, n_out, (a_in, a_out)), "b": _vec(n_out, a_out)})
    params = {"layers": layers}
    return {"params": params, "opt": adamw_state_spec(params)}


def mlp_batch_spec(c):
    sizes = c["sizes"]
    return {"x": Leaf((c["batch"], sizes[0]), ("batch", None), scale=1.0),
            "y": Leaf((c["batch"], sizes[-1]), ("batch", None), scale=1.0)}


def mlp_step(state, batch):
    def loss_fn(params):
        h = batch["x"]
        n = len(params["layers"])
        for i, layer in enumerate(params["layers"]):
            h = h @ layer["w"] + layer["b"]
            if i < n - 1:
                h = constrain(jax.nn.gelu(h), "batch", "mlp" if i % 2 == 0 else "embed")
        return jnp.mean(jnp.square(h - batch["y"]))

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    params, opt = adamw(state["params"], grads, state["opt"])
    return loss, {"params": params, "opt": opt}


# ---------------------------------------------------------------------------------------------
# Registry


@dataclass(frozen=True)
class Model:
    name: str
    config: Any  # (size, devices) -> dict
    state_spec: Any  # cfg -> pytree of Leaf
    batch_spec: Any  # cfg -> pytree of Leaf
    make_step: Any  # cfg -> step(state, batch)

    def build(self, size: str, devices: int = 8):
        cfg = self.config(size, devices)
        return cfg, self.state_spec(cfg), self.batch_spec(cfg), self.make_step(cfg)


MODELS: dict[str, Model] = {
    "gpt": Model("gpt", gpt_config, gpt_state_spec, lm_batch_spec, lambda c: gpt_step),
    "llama": Model("llama", llama_config, llama_state_spec, lm_batch_spec,
                   lambda c: lambda s, b: llama_step(s, b, c)),
    "bert": Model("bert", bert_config, bert_state_spec, bert_batch_spec, lambda c: bert_step),
    "moe": Model("moe", moe_config, moe_state_spec, moe_batch_spec,
                 lambda c: lambda s, b: moe_step(s, b, c)),
    "resnet": Model("resnet", resnet_config, resnet_state_spec, resnet_batch_spec,
                    lambda c: lambda s, b: resnet_step(s, b, c)),
    "mlp": Model("mlp", mlp_config, mlp_state_spec, mlp_batch_spec, lambda c: mlp_step),
}


def export_step(step, state_spec, batch_spec):
    """jax.export.Exported of jax.jit(step) on abstract arguments (no memory needed), the state
    donated as a training loop jits it (the hand plans donate it too)."""
    from jax import export

    return export.export(jax.jit(step, donate_argnums=(0,)))(abstract(state_spec),
                                                              abstract(batch_spec))


def gpt_search_program(layers: int, hidden: int, heads: int, batch: int = 64, seq: int = 1024,
                       vocab: int = 51200, remat: bool = True):
    """Alpa-style GPT train step (exported abstractly) for the search-time benchmark; like
    Alpa's, each layer is rematerialised (without it the 48-layer, hidden-8192 step needs about
    130 GiB of saved activations per device on 32 devices)."""
    cfg = gpt_config("realistic", layers=layers, hidden=hidden, heads=heads, batch=batch, seq=seq)
    cfg["vocab"] = vocab
    return export_step(functools.partial(gpt_step, remat=remat), gpt_state_spec(cfg),
                       lm_batch_spec(cfg))


# ---------------------------------------------------------------------------------------------
# Llama-8B-class train step for a 256-chip slice (benchmarks/tpu_memory.py): Llama 3 8B's
# shapes, optax AdamW, each block rematerialised (jax.checkpoint, as MaxText trains it; without
# it the saved attention probabilities alone take 0.5 GB per layer per device).


def llama8b_config(layers: int = 32, batch: int = 256, seq: int = 2048):
    return dict(vocab=128256, seq=seq, d=4096, heads=32, kv_heads=8, ffn=14336, layers=layers,
                batch=batch)


@functools.cache
def _optax_serializable():
    """optax's state types, registered for jax.export (an Exported's argument tree)."""
    import optax
    from jax import export

    for cls in (optax.ScaleByAdamState, optax.EmptyState):
        export.register_namedtuple_serialization(cls, serialized_name=f"optax.{cls.__name__}")
    return optax


def llama8b_state_spec(c):
    optax = _optax_serializable()
    params = llama_state_spec(c)["params"]
    adam, *rest = jax.eval_shape(optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1).init,
                                 abstract(params))
    moments = adamw_state_spec(params)  # the moments carry their parameters' logical axes
    adam = adam._replace(count=Leaf((), (), jnp.int32, "zeros"), mu=moments["m"],
                         nu=moments["v"])
    return {"params": params, "opt": (adam, *rest)}


def llama8b_step(state, batch, c):
    optax = _optax_serializable()
    block = jax.checkpoint(functools.partial(_llama_block, c=c))

    def loss_fn(params):
        x = params["embed"][batch["tokens"]]
        for layer in params["layers"]:
            x = block(x, layer)
        x = rms_norm(constrain(x, "batch", "seq", "embed"), params["norm"])
        return cross_entropy(x @ params["head"], batch["targets"])

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1).update(
        grads, state["opt"], state["params"])
    return loss, {"params": optax.apply_updates(state["params"], updates), "opt": opt}
