"""Expert hand-written sharding plans, with jax's public sharding API on the original function.

A plan maps the models' logical axis names (see models.py) onto mesh axes, for parameters and
for activations (`models.constrain`, the Flax logical-partitioning pattern), and optionally
shards every parameter and optimizer-state tensor over an FSDP axis group (ZeRO-3):

* replicated: everything on every device (baseline);
* dp: batch over all devices, parameters replicated;
* fsdp: batch over all devices, parameters and optimizer state sharded over all devices too
  (each tensor on its largest divisible dim); XLA all-gathers weights at use and
  reduce-scatters gradients;
* tp (1-axis meshes): Megatron tensor parallel over all devices (column/row splits, heads,
  vocab-parallel embeddings and logits), batch replicated;
* tp_dp (2-axis meshes): data on the first axis, Megatron tensor parallel on the second;
* fsdp_tp (2-axis meshes): tp_dp plus parameters/optimizer state sharded over the data axis;
* ep / ep_dp (MoE only): expert parallel (the experts dim) instead of splitting expert FFNs;
* 3-axis meshes (x, y across nodes, z within a node): dp, fsdp, tp_dp and fsdp_tp with data on
  (x, y) and tensor parallel on z, hsdp_tp (hybrid sharded data parallel: parameters sharded
  over y only, replicated over x, plus tensor parallel on z), ep_dp (experts on z).

`compile_plan` lowers `jax.jit(step, in_shardings=..., out_shardings=...)` on ShapeDtypeStructs
and compiles it (compile only: nothing is allocated).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import models
from jax.sharding import AxisType, NamedSharding, PartitionSpec

TP_NAMES = ("heads", "kv_heads", "mlp", "vocab", "channels_hidden", "classes")


@dataclass(frozen=True)
class HandPlan:
    name: str
    rules: dict  # logical name -> mesh axes (params and activations)
    fsdp: tuple[str, ...] = ()  # mesh axes every parameter/optimizer tensor is also sharded over
    notes: str = ""
    extra: dict = field(default_factory=dict)


def make_mesh(shape: tuple[int, ...]):
    names = ("x", "y", "z")[: len(shape)]
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def plans_for(model_name: str, shape: tuple[int, ...]) -> list[HandPlan]:
    tp_names = TP_NAMES
    if len(shape) == 1:
        data, every = "x", ("x",)
        plans = [
            HandPlan("replicated", {}),
            HandPlan("dp", {"batch": every}),
            HandPlan("fsdp", {"batch": every}, fsdp=every),
            HandPlan("tp", {n: data for n in tp_names}),
        ]
        if model_name == "moe":
            plans.append(HandPlan("ep", {"experts": data}))
        return plans
    if len(shape) == 3:
        data, model, every = ("x", "y"), "z", ("x", "y", "z")
        tp = {n: model for n in tp_names}
        plans = [
            HandPlan("replicated", {}),
            HandPlan("dp", {"batch": every}),
            HandPlan("fsdp", {"batch": every}, fsdp=every),
            HandPlan("tp_dp", {"batch": data, **tp}),
            HandPlan("fsdp_tp", {"batch": data, **tp}, fsdp=data),
            HandPlan("hsdp_tp", {"batch": data, **tp}, fsdp=("y",)),
        ]
        if model_name == "moe":
            plans.append(HandPlan("ep_dp", {"batch": data, "experts": model}))
        return plans
    data, model = "x", "y"
    every = ("x", "y")
    plans = [
        HandPlan("replicated", {}),
        HandPlan("dp", {"batch": every}),
        HandPlan("fsdp", {"batch": every}, fsdp=every),
        HandPlan("tp_dp", {"batch": data, **{n: model for n in tp_names}}),
        HandPlan("fsdp_tp", {"batch": data, **{n: model for n in tp_names}}, fsdp=(data,)),
    ]
    if model_name == "moe":
        plans.append(HandPlan("ep_dp", {"batch": data, "experts": model}))
    return plans


def shard_largest_free_dim(spec: list, shape, fsdp_axes, mesh_shape: dict) -> list:
    """FSDP/ZeRO-3 on top of `spec` (one entry per dim): the mesh axes of `fsdp_axes` that
    `spec` does not use yet go on the largest dim that is still unsharded and divisible."""
    used = {a for e in spec if e for a in ((e,) if isinstance(e, str) else e)}
    axes = tuple(a for a in fsdp_axes if a not in used)
    parts = math.prod(mesh_shape[a] for a in axes)
    if axes and parts > 1:
        free = [d for d in range(len(shape)) if spec[d] is None and shape[d] % parts == 0]
        if free:
            d = max(free, key=lambda d: shape[d])
            spec[d] = axes if len(axes) > 1 else axes[0]
    return spec


def leaf_spec(leaf: models.Leaf, plan: HandPlan, mesh_shape: dict) -> PartitionSpec:
    """Parameter/state spec: the plan's logical rules, then FSDP over the largest free dim."""
    rules = {k: v for k, v in plan.rules.items() if k != "batch"}
    spec = list(models.logical_spec(leaf.axes, rules, leaf.shape, mesh_shape))
    if plan.fsdp and leaf.shape:
        spec = shard_largest_free_dim(spec, leaf.shape, plan.fsdp, mesh_shape)
    return PartitionSpec(*spec)


def batch_spec(leaf: models.Leaf, plan: HandPlan, mesh_shape: dict) -> PartitionSpec:
    return models.logical_spec(leaf.axes, plan.rules, leaf.shape, mesh_shape)


def shardings(plan: HandPlan, mesh, state_spec, batch_spec_tree):
    mesh_shape = dict(mesh.shape)

    def named(fn):
        return lambda leaf: NamedSharding(mesh, fn(leaf, plan, mesh_shape))

    state = jax.tree.map(named(leaf_spec), state_spec, is_leaf=models.is_leaf)
    batch = jax.tree.map(named(batch_spec), batch_spec_tree, is_leaf=models.is_leaf)
    return state, batch


def compile_plan(plan: HandPlan, mesh, step, state_spec, batch_spec_tree, donate: bool = True):
    """Compiled (not run) jax.jit of `step` under `plan` on `mesh`."""
    state_sh, batch_sh = shardings(plan, mesh, state_spec, batch_spec_tree)
    loss_sh = NamedSharding(mesh, PartitionSpec())
    def fresh(state, batch):  # a new function object: jit's trace cache ignores the rules
        return step(state, batch)

    jitted = jax.jit(fresh, in_shardings=(state_sh, batch_sh), out_shardings=(loss_sh, state_sh),
                     donate_argnums=(0,) if donate else ())
    act_rules = {k: (v if isinstance(v, str) else tuple(v)) for k, v in plan.rules.items()}
    with models.logical_rules(mesh, act_rules):
        lowered = jitted.lower(models.abstract(state_spec), models.abstract(batch_spec_tree))
    return lowered.compile()


def run_plan(plan: HandPlan, mesh, step, state_spec, batch_spec_tree, state, batch):
    """Run `step` on concrete `state` and `batch` under `plan` (the numerics check): the same
    compiled program as `compile_plan`, without donation, fed arrays placed as the plan says."""
    compiled = compile_plan(plan, mesh, step, state_spec, batch_spec_tree, donate=False)
    state_sh, batch_sh = shardings(plan, mesh, state_spec, batch_spec_tree)
    return compiled(jax.device_put(state, state_sh), jax.device_put(batch, batch_sh))


def describe(plan: HandPlan, mesh, state_spec) -> dict:
    """A few parameter specs, to show what the plan does (for reports)."""
    mesh_shape = dict(mesh.shape)
    flat, _ = jax.tree_util.tree_flatten_with_path(state_spec, is_leaf=models.is_leaf)
    out = {}
    for path, leaf in flat:
        name = jax.tree_util.keystr(path)
        if len(leaf.shape) >= 2 and "['opt']" not in name and "[1]" not in name \
                and "[2]" not in name and "[3]" not in name:
            out[name] = str(leaf_spec(leaf, plan, mesh_shape))
    return out


def exported_plans(exported, donated: tuple[int, ...], mesh, tensor_dim=None,
                   expert_dim=None) -> dict[str, tuple]:
    """The hand plans for a program known as a single-device jax.export.Exported (the
    third-party corpus's train steps): the top-level arguments `donated` names are the
    training state, the others the batch.

    * dp: every batch tensor split on its leading dim over all mesh axes (replicated where
      the device count does not divide it), the state replicated;
    * fsdp: dp, and every state tensor on its largest dim the device count divides;

    and where the expert who knows the model gives `tensor_dim(path, shape)` (the dim of a
    state tensor Megatron splits, corpus_hand_rules.py; `path` its jax.tree_util.keystr in
    the parameters, an optimizer moment's that of its parameter: _parameter_paths) or
    `expert_dim` (likewise, the experts' dim), on a mesh of two axes or more,
    the data over the first and the model over the last:

    * tp_dp: the batch over the first axis, each state tensor's `tensor_dim` over the last
      (where the axis divides it);
    * fsdp_tp: tp_dp, and every state tensor also on its largest free dim the first axis
      divides;
    * ep_dp: the batch over the first axis, each expert weight's experts over the last.

    A model-parallel plan whose rules split no tensor over the last axis (8 experts over 16
    devices) is left out.

    {name: (in_shardings, out_shardings)} for jax.jit(exported.call): the results that repeat
    the state tensors in order (same shape and dtype; a train step returns its new state) keep
    their sharding, the others (the loss) are replicated."""
    every = tuple(mesh.axis_names)
    mesh_shape = dict(mesh.shape)
    args, kwargs = jax.tree.unflatten(exported.in_tree, exported.in_avals)
    if kwargs:
        raise ValueError("exported_plans: keyword arguments are not supported")
    out_avals = jax.tree.unflatten(exported.out_tree, exported.out_avals)
    replicated = NamedSharding(mesh, PartitionSpec())

    def batch_over(axes):
        parts = math.prod(mesh_shape[a] for a in axes)

        def batch(aval):
            split = aval.shape and aval.shape[0] % parts == 0
            return NamedSharding(mesh, PartitionSpec(axes) if split else PartitionSpec())
        return batch

    paths = _parameter_paths(args, donated)

    def state_over(model_dim=None, model_axis=None, fsdp_axes=()):
        def state(where, aval):
            spec = [None] * len(aval.shape)
            if model_dim is not None:
                dim = model_dim(paths[where], tuple(aval.shape))
                if dim is not None and aval.shape[dim] % mesh_shape[model_axis] == 0:
                    spec[dim] = model_axis
            if fsdp_axes:
                spec = shard_largest_free_dim(spec, aval.shape, fsdp_axes, mesh_shape)
            return NamedSharding(mesh, PartitionSpec(*spec) if any(spec) else PartitionSpec())
        return state

    layouts = {"dp": (state_over(), batch_over(every)),
               "fsdp": (state_over(fsdp_axes=every), batch_over(every))}
    if len(every) >= 2:
        data, model = every[:1], every[-1]
        if tensor_dim is not None:
            layouts["tp_dp"] = (state_over(tensor_dim, model), batch_over(data))
            layouts["fsdp_tp"] = (state_over(tensor_dim, model, data), batch_over(data))
        if expert_dim is not None:
            layouts["ep_dp"] = (state_over(expert_dim, model), batch_over(data))

    plans, skipped = {}, set()
    for name, (state, batch) in layouts.items():
        ins = tuple(jax.tree.unflatten(jax.tree.structure(arg), [
            state((i, k), aval) if i in donated else batch(aval)
            for k, aval in enumerate(jax.tree.leaves(arg))]) for i, arg in enumerate(args))
        if name in ("tp_dp", "ep_dp") and not any(
                s.spec for i in donated for s in jax.tree.leaves(ins[i])):
            skipped.add(name)  # the rules split no tensor over this mesh's model axis
        if name in skipped or name == "fsdp_tp" and "tp_dp" in skipped:
            continue
        kept = [(aval, sharding)
                for i, arg in enumerate(args) if i in donated
                for aval, sharding in zip(jax.tree.leaves(arg), jax.tree.leaves(ins[i]))]
        plans[name] = (ins, _results_keeping(kept, out_avals, replicated))
    return plans


def _parameter_paths(args, donated: tuple[int, ...]) -> dict[tuple[int, int], str]:
    """{(argument, leaf index): path} of the state tensors: the first state argument's own
    paths (jax.tree_util.keystr), and, for a later one (an optimizer state the program takes
    as a flat list: optax's count, then each moment's tensors in the parameters' order), the
    path of the parameter each tensor repeats, matched in order by shape."""
    if not donated:
        return {}
    first, *rest = sorted(donated)
    params = jax.tree_util.tree_flatten_with_path(args[first])[0]
    paths = {(first, k): jax.tree_util.keystr(path) for k, (path, _) in enumerate(params)}
    for i in rest:
        position = 0
        for k, (path, aval) in enumerate(jax.tree_util.tree_flatten_with_path(args[i])[0]):
            paths[i, k] = jax.tree_util.keystr(path)
            if params and aval.shape == params[position % len(params)][1].shape:
                paths[i, k] = paths[first, position % len(params)]
                position += 1
    return paths


def _results_keeping(kept: list, out_avals, default):
    """Result shardings: each result that repeats the next of `kept` ((aval, sharding) of the
    state tensors, in order) in shape and dtype takes its sharding, the others `default`."""
    remaining = iter(kept)
    pending = next(remaining, None)

    def result(aval):
        nonlocal pending
        if pending is not None and (pending[0].shape, pending[0].dtype) == \
                (aval.shape, aval.dtype):
            sharding, pending = pending[1], next(remaining, None)
            return sharding
        return default

    return jax.tree.map(result, out_avals)


def compile_exported_plan(exported, donated: tuple[int, ...], shardings: tuple):
    """Compiled (not run) jax.jit of `exported.call` under one of exported_plans' shardings,
    with the state donated as the train loop donates it."""
    ins, outs = shardings
    args, _ = jax.tree.unflatten(exported.in_tree, exported.in_avals)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    jitted = jax.jit(exported.call, in_shardings=ins, out_shardings=outs,
                     donate_argnums=donated)
    return jitted.lower(*abstract).compile()
