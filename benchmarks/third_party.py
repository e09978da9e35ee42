"""Plan quality on train steps written with other people's libraries: the Flax NNX transformer
(nnx.MultiHeadAttention, nnx.LayerNorm, optax AdamW), the Equinox MLP (eqx.nn.MLP, the
equinox-docs step) and the Keras 3 MLP and CNN (Sequential Dense / Conv2D +
BatchNormalization, the stateless step of Keras' JAX training-loop guide, Keras AdamW) of
examples/third_party/, exported as their docs suggest, at a realistic size; hloplan against
the plans an expert writes for them with jax's sharding API, every plan scored by run.py's
formula on its compiled per-device HLO; hloplan's predicted collective bytes against those in
its compiled program (run.py's fidelity check); and, where hloplan loses, why (run.py's
explanation, and the plan made for the formula's own assumptions).

    .venv/bin/python benchmarks/third_party.py [--meshes 8,2x4,4x2,4x8]

The hand plans work on the step as its users hold it: parameters as Flax's pure dict, the optax
state as its flat list of leaves, Keras' (trainable, non-trainable) variable lists and its
optimizer variables (each Adam moment sharded like its parameter):

* dp: tokens and labels split over every device, parameters and optimizer state replicated;
* fsdp: dp, with every parameter and moment sharded on its largest divisible dim (ZeRO-3);
* tp_dp (2-axis meshes): batch over the first axis, Megatron tensor parallel over the second
  (transformer, by parameter path: attention heads of query/key/value/out, the MLP's hidden
  units, vocabulary rows of the embedding and columns of the head; MLPs: layers alternately
  split on their outputs and inputs; none for the CNN, which experts train data parallel);
* fsdp_tp (2-axis meshes): tp_dp, with what tp leaves unsharded split over the first axis;
* fsdp_gather, fsdp_tp_gather: the same, with the step wrapped to all-gather the parameters
  (`with_sharding_constraint` to the dp / tp_dp layout) before it uses them.

Writes benchmarks/third_party_results.json; the README shows the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import run  # sets XLA_FLAGS (32 simulated devices) before jax is imported

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples" / "third_party"

# Realistic work per device: 8 sequences of 512 tokens (4,096 tokens) per device, hidden 1024.
# The transformer: flax_train_step.py's size="real" widths (1,024 wide, 16 heads, vocabulary
# 32,768) over 512-token sequences.
TRANSFORMER_SEQ = 512
SEQUENCES_PER_DEVICE = 8
LAYERS = 2
# The MLP of benchmarks/models.py (2048 -> 8192 -> 8192 -> 2048), 4,096 rows per device.
MLP = {"in_size": 2048, "width": 8192, "out_size": 2048, "depth": 2}
ROWS_PER_DEVICE = 4096
# The Keras CNN at the size of benchmarks/models.py's ResNet: 128x128 images, 32 per device,
# two 3x3 convolutions (each with batch norm) at each of 128, 256 and 512 channels.
KERAS_CNN = {"image": 128, "channels": (128, 256, 512), "classes": 1024, "convs_per_stage": 2}
IMAGES_PER_DEVICE = 32

# Megatron tensor parallel by parameter path: (path fragment, dim sharded over the model axis).
TRANSFORMER_TP = (
    ("['attn']['query']['kernel']", 1), ("['attn']['key']['kernel']", 1),
    ("['attn']['value']['kernel']", 1), ("['attn']['out']['kernel']", 0),
    ("['up']['kernel']", 1), ("['up']['bias']", 0), ("['down']['kernel']", 0),
    ("['embed']['embedding']", 0), ("['head']['kernel']", 1), ("['head']['bias']", 0),
)


def _example(script: str):
    spec = importlib.util.spec_from_file_location(f"third_party_{script}", EXAMPLES / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    if str(EXAMPLES) not in sys.path:  # the examples import their _common
        sys.path.insert(0, str(EXAMPLES))
    spec.loader.exec_module(module)
    return module


def build_transformer(devices: int):
    """(step, args) of the Flax NNX transformer at the realistic size for `devices`."""
    return _example("flax_train_step").nnx_transformer(
        LAYERS, size="real", batch=SEQUENCES_PER_DEVICE * devices, seq=TRANSFORMER_SEQ)


def transformer_tp(names: list[tuple[str, tuple[int, ...]]]) -> dict[str, int]:
    return {name: dim for name, _ in names for fragment, dim in TRANSFORMER_TP
            if name.endswith(fragment)}


def build_mlp(devices: int):
    """(step, args) of the Equinox MLP (eqx.nn.MLP, optax AdamW) at the realistic size."""
    return _example("equinox_train_step").eqx_mlp(**MLP, batch=ROWS_PER_DEVICE * devices)


def alternating_tp(names: list[tuple[str, tuple[int, ...]]], out_dim: int) -> dict[str, int]:
    """Megatron over an MLP's [weight, bias, ...] leaves: even layers split their outputs
    (weight dim `out_dim` and the bias), odd layers their inputs (the other weight dim)."""
    out, layer = {}, -1
    for name, shape in names:
        if len(shape) == 2:
            layer += 1
            out[name] = out_dim if layer % 2 == 0 else 1 - out_dim
        elif layer % 2 == 0:
            out[name] = 0
    return out


def mlp_tp(names: list[tuple[str, tuple[int, ...]]]) -> dict[str, int]:
    """eqx.nn.MLP's flat leaves: weights (out, in)."""
    return alternating_tp(names, out_dim=0)


def _keras_step(step, state, data):
    """The Keras stateless step (`step(state, data) -> (loss, state)`, state = (trainable,
    non_trainable, optimizer variables)) in this benchmark's convention: (params, optimizer
    leaves, inputs, targets) -> (params, optimizer leaves, loss), params = (trainable,
    non_trainable). The exported program has the same leaves in the same order."""
    trainable, non_trainable, optimizer_variables = state

    def four_argument_step(params, opt_leaves, x, y):
        loss, (trainable, non_trainable, opt_leaves) = step((*params, opt_leaves), (x, y))
        return (trainable, non_trainable), opt_leaves, loss

    return four_argument_step, ((trainable, non_trainable), optimizer_variables, *data)


def build_keras_mlp(devices: int):
    """(step, args) of the Keras MLP (Sequential Dense layers, AdamW) at the MLP's size."""
    step, (state, data) = _example("keras_train_step").keras_mlp(
        **MLP, batch=ROWS_PER_DEVICE * devices)
    return _keras_step(step, state, data)


def build_keras_cnn(devices: int):
    """(step, args) of the Keras CNN (Conv2D, BatchNormalization, AdamW) at ResNet-like size."""
    step, (state, data) = _example("keras_train_step").keras_cnn(
        **KERAS_CNN, batch=IMAGES_PER_DEVICE * devices)
    return _keras_step(step, state, data)


def _keras_trainable(names: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
    """The trainable variables among the Keras params' leaves (params = (trainable,
    non_trainable), see _keras_step)."""
    return [(name, shape) for name, shape in names if name.startswith("[0]")]


def keras_mlp_tp(names: list[tuple[str, tuple[int, ...]]]) -> dict[str, int]:
    """The Keras Dense layers' trainable variables: kernels (in, out)."""
    return alternating_tp(_keras_trainable(names), out_dim=1)


def keras_owners(params, opt_leaves) -> list[str | None]:
    """The trainable variable each Keras AdamW variable mirrors: after the iteration and
    learning-rate scalars come, per trainable variable, its momentum and its velocity."""
    trainable = [name for name, _ in _keras_trainable(param_names(params))]
    mirrored = [name for name in trainable for _ in ("momentum", "velocity")]
    return [None] * (len(opt_leaves) - len(mirrored)) + mirrored


# model -> (build, tensor-parallel rule or None (no tp plans), optimizer-leaf owners)
MODELS = {"flax nnx_transformer": (build_transformer, transformer_tp, None),
          "equinox mlp": (build_mlp, mlp_tp, None),
          "keras mlp": (build_keras_mlp, keras_mlp_tp, keras_owners),
          "keras cnn": (build_keras_cnn, None, keras_owners)}


def param_names(params) -> list[tuple[str, tuple[int, ...]]]:
    import jax

    return [(jax.tree_util.keystr(path), tuple(leaf.shape))
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]]


def moment_owners(params, opt_leaves) -> list[str | None]:
    """The parameter each optax leaf mirrors (Adam's mu and nu follow the parameters' leaf order),
    None for the step counters."""
    names = param_names(params)
    owners, at = [], 0
    for leaf in opt_leaves:
        name, shape = names[at]
        if tuple(leaf.shape) == shape:
            owners.append(name)
            at = (at + 1) % len(names)
        else:
            owners.append(None)
    return owners


def leaf_spec(plan: str, name: str | None, shape: tuple[int, ...], mesh_shape: dict,
              tp: dict[str, int]):
    import hand_plans
    from jax.sharding import PartitionSpec

    axes = tuple(mesh_shape)
    spec: list = [None] * len(shape)
    if name in tp and plan in ("tp_dp", "fsdp_tp"):
        model, dim = axes[-1], tp[name]
        if shape[dim] % mesh_shape[model] == 0:
            spec[dim] = model
    fsdp = {"fsdp": axes, "fsdp_tp": axes[:1]}.get(plan, ())
    if fsdp and shape:
        spec = hand_plans.shard_largest_free_dim(spec, shape, fsdp, mesh_shape)
    return PartitionSpec(*spec)


HAND_PLANS = ("dp", "fsdp", "fsdp_gather", "tp_dp", "fsdp_tp", "fsdp_tp_gather")


def plans_for(mesh_shape: dict, tp_rule=True) -> list[str]:
    """Tensor parallel needs a second mesh axis (and a model with a tensor-parallel rule)."""
    return [p for p in HAND_PLANS if (len(mesh_shape) == 2 and tp_rule) or "tp" not in p]


def compile_hand_plan(plan: str, mesh, step, args, tp_rule, owners=None):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    params, opt_leaves, tokens, labels = args
    mesh_shape = dict(mesh.shape)
    gather = plan.endswith("_gather")
    plan = plan.removesuffix("_gather")
    flat, tree = jax.tree_util.tree_flatten_with_path(params)
    tp = tp_rule(param_names(params)) if tp_rule else {}

    def params_sharding(plan):
        return jax.tree.unflatten(tree, [
            NamedSharding(mesh, leaf_spec(plan, jax.tree_util.keystr(p), tuple(x.shape),
                                          mesh_shape, tp)) for p, x in flat])

    params_sh = params_sharding(plan)
    if gather:
        # FSDP as one writes it around a model one does not edit: the step all-gathers the
        # parameters (to their tensor-parallel layout) before using them; the gradients come
        # back through the constraint's transpose to the sharded layout. Without it XLA may
        # keep a weight sharded on its contracting dim and move activations instead.
        use_sh = params_sharding("tp_dp" if plan == "fsdp_tp" else "dp")
        user_step = step

        def step(params, opt_leaves, tokens, labels):
            return user_step(jax.lax.with_sharding_constraint(params, use_sh), opt_leaves,
                             tokens, labels)
    opt_sh = [NamedSharding(mesh, leaf_spec(plan, owner, tuple(x.shape), mesh_shape, tp))
              for owner, x in zip((owners or moment_owners)(params, opt_leaves), opt_leaves)]
    batch_axes = tuple(mesh_shape) if plan in ("dp", "fsdp") else tuple(mesh_shape)[:1]
    batch_sh = NamedSharding(mesh, PartitionSpec(batch_axes if len(batch_axes) > 1
                                                 else batch_axes[0]))
    loss_sh = NamedSharding(mesh, PartitionSpec())
    jitted = jax.jit(step, in_shardings=(params_sh, opt_sh, batch_sh, batch_sh),
                     out_shardings=(params_sh, opt_sh, loss_sh), donate_argnums=(0, 1))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    return jitted.lower(*abstract).compile()


def run_case(model: str, mesh: str, workdir: str) -> dict:
    import hand_plans

    shape = run.mesh_shape(mesh)
    devices = math.prod(shape)
    comm = run.comm_model(mesh)
    started = time.perf_counter()
    build, tp_rule, owners = MODELS[model]
    step, args = build(devices)
    slug = model.replace(" ", "_")
    path = Path(workdir) / f"{slug}_{devices}.jaxexport"
    path.write_bytes(_example("_common").export_step(step, args))
    case: dict = {"model": model, "mesh": mesh, "devices": devices,
                  "batch": int(args[2].shape[0]),
                  "parameters": sum(math.prod(s) for _, s in param_names(args[0]))}
    hl, plan_json = run.plan_and_measure(path, mesh, Path(workdir) / f"plan_{slug}_{mesh}",
                                         run.DEVICE, comm)
    case["hloplan"] = hl
    jmesh = hand_plans.make_mesh(shape)
    mesh_axes = tuple(jmesh.shape.items())
    hand = {}
    for plan in plans_for(dict(jmesh.shape), tp_rule):
        try:
            hand[plan] = run.measure(compile_hand_plan(plan, jmesh, step, args, tp_rule, owners),
                                     mesh_axes, comm)
        except Exception as exc:  # a plan XLA cannot compile is a result too
            hand[plan] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    case["hand"] = hand
    case.update(run.hand_ratios(hl, hand))
    if "error" not in hl:
        case["fidelity"] = run.fidelity(hl)
    if case["ratio"] is not None and case["ratio"] > run.LOSS_THRESHOLD:
        best = case["best_hand"]
        case["why"] = run.why_it_loses(path, mesh, Path(workdir) / f"formula_{slug}_{mesh}",
                                       comm, hl, hand[best], best, plan_json)
    case["wall_s"] = time.perf_counter() - started
    return case


def hand_cell(result: dict | None, digits: int = 2) -> str:
    """A hand plan's table cell: its step in ms, "(OOM)" when it does not fit, "-" when not
    planned."""
    if result is None:
        return "-"
    if "error" in result:
        return "error"
    return f"{result['step_s'] * 1e3:.{digits}f}" + ("" if result["fits"] else " (OOM)")


def table(cases: list[dict]) -> list[str]:
    lines = ["| model | mesh | hloplan step (ms) | " + " | ".join(HAND_PLANS)
             + " | **ratio** (vs) | ratio, per-kernel roofline (vs) | hloplan peak GiB |"
               " predicted / compiled collective bytes (kind and axes match) |",
             "|---|---|---|" + "---|" * len(HAND_PLANS) + "---|---|---|---|"]
    for c in cases:
        hl = c["hloplan"]
        cells = [hand_cell(c["hand"].get(plan)) for plan in HAND_PLANS]
        if "error" in hl:
            lines.append(f"| {c['model']} | {c['mesh']} | error: {hl['error'][:80]} | "
                         + " | ".join(cells) + " | | | |")
            continue
        lines.append(f"| {c['model']} | {c['mesh']} | {hl['step_s'] * 1e3:.2f} | "
                     + " | ".join(cells)
                     + f" | {c.get('ratio', float('nan')):.3f} ({c.get('best_hand')}) | "
                       f"{c.get('ratio_kernels', float('nan')):.3f} ({c.get('best_hand_kernels')})"
                       f" | {hl['peak_bytes'] / 2**30:.2f} | {_fidelity_cell(c.get('fidelity'))} |")
    return lines


def _fidelity_cell(f: dict | None) -> str:
    if not f or f["ratio"] is None:
        return "-"
    return f"{f['ratio']:.3f} ({f['axes_match']:.3f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # The third-party plans are written for meshes of one or two axes (no 3-axis tensor-parallel
    # rules): the 1,024-device mesh is run.py's only.
    parser.add_argument("--meshes", default=",".join(m for m in run.MESHES
                                                     if len(run.mesh_shape(m)) < 3))
    parser.add_argument("--models", default=",".join(MODELS),
                        help="comma-separated subset of " + ",".join(MODELS))
    parser.add_argument("--out", default=str(HERE / "third_party_results.json"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    cases = []
    with tempfile.TemporaryDirectory(prefix="hloplan-third-party-") as workdir:
        for model, mesh in [(m, mesh) for m in args.models.split(",")
                            for mesh in args.meshes.split(",")]:
            case = run_case(model, mesh, workdir)
            cases.append(case)
            run.print_case(case)  # with, where hloplan loses, why
    results = {"cases": cases, "wall_s": time.perf_counter() - started,
               "device_model": run.DEVICE, "formula": "as benchmarks/run.py"}
    Path(args.out).write_text(json.dumps(results, indent=1, sort_keys=True, default=str) + "\n")
    print("\n".join(table(cases)))
    print(f"wrote {args.out} in {results['wall_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
