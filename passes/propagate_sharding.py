"""propagate-sharding: write the chosen shardings into the module in Shardy form.

The mesh goes in as `sdy.mesh @mesh`; main's arguments and results get `sdy.sharding`; every
planned op's results are fixed by an `sdy.sharding_constraint` right after it (XLA keeps
constraints; it re-propagates `sdy.sharding` attributes on ops as it likes), but on TPU device
models an elementwise op, reshape, transpose or broadcast whose layout XLA derives from its
operands' is left to that propagation (constrain_implied), and a result only such a transpose
reads is pinned after the transpose instead (libtpu folds the transpose into the matmul before
it only with no constraint between them); where a strategy needs an operand in another layout
than its producer gives, a second constraint before the consumer makes that resharding
explicit, so XLA's partitioner does what the plan priced (and where the plan priced a
multi-axis all-gather axis by axis, a constraint per stage). A matmul priced as reading a value
from an earlier matmul's layout (a weight all-gathered once for the forward and backward
matmuls) gets its constraint on the earlier one's constrained operand unless resharding from
the value's own layout is cheaper: XLA reshards from the value otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from hloplan import ir
from hloplan.op_rules import is_elementwise
from hloplan.state import CompileState
from hloplan.strategies import replicated, spec_names, spec_text


@dataclass(frozen=True)
class PropagateSharding:
    name: str = "propagate-sharding"
    # Insert sharding constraints where a consumer needs another layout than its producer's.
    constrain_operands: bool = True
    # Constrain results the plan replicates too. False leaves them to XLA's propagation from
    # the pinned arguments and results: the data-parallel candidate of `--select compiled`,
    # whose every other value is batch-split. libtpu turns a replicated f32 optimizer
    # update's constraints into layout copies (30 of them, 0.12 ms of a 0.75 ms GPT step on
    # v5e:4x8) that the unconstrained program does not have.
    constrain_replicated: bool = True
    # Constrain results whose layout XLA's propagation derives from their operands' alone
    # (implied_layout) too; None: not on TPU device models. libtpu compiles a constraint as a
    # copy that layout assignment may make a real transpose and that splits the fusion around
    # it: linen_resnet's GroupNorm reshapes on v5e:2x4 compiled to 82 layout copies, 6.0 ms
    # against 4.3 without them, the same collectives.
    constrain_implied: bool | None = None

    def apply(self, state: CompileState) -> None:
        mesh = state.options.mesh
        graph, handles = state.graph, state.handles
        annotator = ir.Annotator(state.program.module, handles)
        annotator.set_mesh(mesh.axis_names, mesh.axis_sizes)
        constrain_implied = self.constrain_implied
        if constrain_implied is None:
            constrain_implied = state.comm.model.platform != "tpu"
        implied = 0
        implied_memo: dict[tuple[int, int], bool] = {}

        def is_implied(op_index: int, result: int) -> bool:  # asked again for transposes
            if (op_index, result) not in implied_memo:
                implied_memo[op_index, result] = self._implied(state, op_index, result)
            return implied_memo[op_index, result]

        per_mlir_op: dict[int, tuple[object, dict[int, tuple]]] = {}
        # (op, operand, the specs to pin in order[, the earlier reader and its operand])
        operand_constraints: list[tuple[object, int, list]] = []
        chained: list[tuple[object, int, list, object, int]] = []
        pins: list[tuple[object, int, list, list]] = []  # (while, carry, at entry, at yield)
        argument_specs: dict[int, tuple] = {}
        moved = 0  # results pinned after the transpose that reads them (_only_transposed)
        for op_index in state.space.strategies:
            op = graph.ops[op_index]
            chosen = state.chosen(op_index)
            if op.name == "arg":
                argument_specs[op.attrs["index"]] = spec_names(chosen.results[0], mesh)
                continue
            mlir_op, result_indices = handles.ops[op_index]
            if op.name == "while.carry":
                carry = chosen.results[0]
                pins.append((mlir_op, op.attrs["result"],
                             self._pinned(state, op.operands[0], carry),
                             self._pinned(state, op.attrs.get("yield"), carry)))
                continue
            entry = per_mlir_op.setdefault(id(mlir_op), (mlir_op, {}))
            # result_indices number the MLIR op's results; k the graph op's
            for k, (result_index, spec) in enumerate(zip(result_indices, chosen.results)):
                if not constrain_implied and is_implied(op_index, k):
                    implied += 1
                    continue
                pinned = entry
                transpose = None if constrain_implied else self._only_transposed(
                    state, op_index, k, is_implied)
                if transpose is not None:  # the transpose's result pinned instead
                    moved += 1
                    target, (result_index,) = handles.ops[transpose]
                    spec = state.chosen(transpose).results[0]
                    pinned = per_mlir_op.setdefault(id(target), (target, {}))
                if self.constrain_replicated or any(spec):
                    pinned[1][result_index] = spec_names(spec, mesh)
            if not self.constrain_operands or op.name == "case.result":
                continue
            for k, value_id in enumerate(op.operands):
                required = chosen.operands[k] if k < len(chosen.operands) else None
                given = self._given(state, value_id)
                if required is None or given is None or given == required:
                    continue
                operand_index = op.attrs["result"] if op.name in ("while.carry", "barrier.result") else k
                via = state.space.reads_via.get((op_index, k))
                if via is not None and self._from_earlier(state, value_id, via, given, required):
                    earlier = state.chosen(via[0]).operands[via[1]]
                    chained.append((mlir_op, operand_index,
                                    self._stages(state, value_id, earlier, required),
                                    handles.ops[via[0]][0], via[1]))
                    continue
                operand_constraints.append((mlir_op, operand_index,
                                            self._stages(state, value_id, given, required)))
        results = 0
        for mlir_op, specs in per_mlir_op.values():
            annotator.constrain_results(mlir_op, specs)
            results += len(specs)
        # Pins and operand constraints go in after the result constraints, so that one that
        # would repeat the layout its operand already has is left out.
        for mlir_op, result_index, entry, back in pins:
            annotator.pin_while_carry(mlir_op, result_index, entry, back)
        for mlir_op, operand_index, specs in operand_constraints:
            for spec in specs:
                annotator.constrain_operand(mlir_op, operand_index, spec)
        for mlir_op, operand_index, specs, earlier, earlier_index in chained:
            annotator.constrain_operand(mlir_op, operand_index, specs[0],
                                        source=(earlier, earlier_index))
            for spec in specs[1:]:
                annotator.constrain_operand(mlir_op, operand_index, spec)
        annotator.set_arguments(argument_specs)
        result_specs = {}
        for index, value_id in enumerate(graph.outputs):
            result_specs[index] = spec_names(self._layout(state, value_id), mesh)
        self._keep_donated_layouts(state, result_specs)
        annotator.set_results(result_specs)
        state.facts["sharding_constraints"] = sum(len(pin[2]) + len(pin[3]) for pin in pins) + sum(
            len(entry[2]) for entry in operand_constraints + chained)
        state.facts["result_constraints"] = results
        state.facts["implied_results"] = implied
        state.facts["pinned_after_transpose"] = moved

    def _only_transposed(self, state: CompileState, op_index: int, result: int,
                         is_implied) -> int | None:
        """The transpose that is the only reader of the op's result, where it takes the result
        as it is and its own layout is implied (_implied): its result is pinned instead of
        the op's. libtpu folds a transpose right after a matmul into the matmul, but not
        across a constraint: a weight gradient made as [out, in] and transposed to the
        weight's [in, out] is then all-reduced as [out, in] and the transpose becomes a
        layout, which the optimizer update takes on, with the weight and both moments copied
        into it and back (6 copies of f32[512, 2048] on v5e:2x4), where the unconstrained
        transpose leaves none."""
        graph = state.graph
        value_id = graph.ops[op_index].results[result]
        users = set(graph.values[value_id].users)
        if len(users) != 1 or value_id in graph.outputs:
            return None
        (reader,) = users
        if (graph.ops[reader].name != "stablehlo.transpose" or reader not in state.space.strategies
                or state.chosen(reader).operands[0] not in (None, self._given(state, value_id))
                or not is_implied(reader, 0)):
            return None
        return reader

    def _implied(self, state: CompileState, op_index: int, result: int) -> bool:
        """Whether the op's result layout follows from its operands' layouts alone, as XLA's
        propagation maps them (implied_layout), and every reader takes it in that layout (a
        reader resharding it could pull the layout back otherwise)."""
        graph = state.graph
        op = graph.ops[op_index]
        value_id = op.results[result]
        chosen = state.chosen(op_index)
        if len(op.results) != 1 or value_id in graph.outputs:
            return False
        operands = []
        for k, operand in enumerate(op.operands):
            layout = chosen.operands[k] if k < len(chosen.operands) else None
            operands.append((graph.type_of(operand).shape,
                             layout if layout is not None else self._given(state, operand)))
        if implied_layout(op, operands, graph.type_of(value_id).shape) != chosen.results[0]:
            return False
        for user in graph.values[value_id].users:
            reader = graph.ops[user]
            if user not in state.space.strategies or reader.name in ("while.carry",
                                                                     "case.result"):
                return False
            required = state.chosen(user).operands
            for k, operand in enumerate(reader.operands):
                if operand == value_id and k < len(required) and required[k] is not None \
                        and required[k] != chosen.results[0]:
                    return False
        return True

    def _layout(self, state: CompileState, value_id: int):
        spec = self._given(state, value_id)
        return spec if spec is not None else replicated(state.graph.type_of(value_id).rank)

    def _keep_donated_layouts(self, state: CompileState, result_specs: dict[int, tuple]) -> None:
        """A result written into a donated argument's buffer must have the argument's layout
        (XLA aliases buffers of the same shape per device only, and the next step passes the
        result back in that layout). Where the plan lays one out otherwise, it is resharded
        there at the end of the program (not priced; said so). Records state.facts["donation"]."""
        graph, mesh = state.graph, state.options.mesh
        aliases = graph.output_aliases()
        resharded = []
        for index, position in sorted(aliases.items()):
            stored = self._layout(state, graph.arguments[position])
            wanted = spec_names(stored, mesh)
            if result_specs[index] == wanted:
                continue
            resharded.append(index)
            made = spec_text(self._layout(state, graph.outputs[index]), mesh)
            name, argument = graph.output_names[index], graph.argument_names[position]
            state.log.warn(
                f"donated argument {argument} is laid out {spec_text(stored, mesh)}, but the "
                f"plan makes {name}, which is written into its buffer, as {made}: resharded to "
                f"{spec_text(stored, mesh)} at the end of the program (not priced)",
                graph.ops[graph.values[graph.arguments[position]].producer].location,
                "stablehlo.return")
            result_specs[index] = wanted
        state.facts["donation"] = {
            "arguments": sorted(graph.donated),
            "aliases": [[position, index] for index, position in sorted(aliases.items())],
            "resharded_results": resharded,
        }

    @staticmethod
    def _from_earlier(state: CompileState, value_id: int, via: tuple[int, int], given,
                      required) -> bool:
        """Whether to reshard a value for its reader from the earlier reader's layout `via`
        (as the plan priced it) rather than from the value's own: when the earlier reader
        resharded it, and going on from there costs no more (else the plan's price was an
        upper bound)."""
        earlier = state.chosen(via[0]).operands[via[1]]
        if earlier in (given, None):
            return False  # the earlier reader takes the value as it is
        if earlier == required:
            return True  # the same reshard: reuse it
        type_ = state.graph.type_of(value_id)

        def seconds(src) -> float:
            return state.comm.reshard(type_.shape, type_.itemsize, src, required).seconds

        return seconds(earlier) <= seconds(given)

    @staticmethod
    def _stages(state: CompileState, value_id: int, src, dst) -> list[tuple]:
        """The layouts to pin, in order, to take a value from `src` to `dst` as the plan
        priced it: `dst`, after the layouts of a staged all-gather (CommModel.reshard's via)."""
        type_ = state.graph.type_of(value_id)
        via = state.comm.reshard(type_.shape, type_.itemsize, src, dst).via
        mesh = state.options.mesh
        return [spec_names(layout, mesh) for layout in (*via, dst)]

    def _pinned(self, state: CompileState, value_id: int | None, carry) -> list[tuple]:
        """The layouts to pin a loop-carried value to, in order, where `value_id` (the loop's
        initial value, or the body's yielded one) enters the carry's layout `carry`."""
        given = None if value_id is None else self._given(state, value_id)
        if given is None or given == carry:
            return [spec_names(carry, state.options.mesh)]
        return self._stages(state, value_id, given, carry)

    @staticmethod
    def _given(state: CompileState, value_id: int):
        value = state.graph.values[value_id]
        if value_id in state.space.free_values or value.producer not in state.space.strategies:
            return None
        return state.chosen(value.producer).results[value.result_index]


def implied_layout(op, operands: list[tuple[tuple[int, ...], object]], shape: tuple[int, ...]):
    """The result layout XLA's propagation gives an elementwise op, reshape, transpose or
    broadcast from its operands' ((shape, layout or None) pairs) where that is unambiguous,
    else None: an elementwise op's full-rank operands with a layout all in one; a transpose's
    permuted; a broadcast's operand dims kept where their size is; a reshape's sharded dims
    that it keeps whole (same size at the same position in the flattened order)."""
    if is_elementwise(op.name):
        # Operands without a layout (constants, free values) take whatever their reader's is.
        layouts = {layout for dims, layout in operands
                   if len(dims) == len(shape) and layout is not None}
        return layouts.pop() if len(layouts) == 1 else None
    if not operands or operands[0][1] is None:
        return None
    dims, layout = operands[0]
    if op.name == "stablehlo.transpose":
        return tuple(layout[d] for d in op.attrs["permutation"])
    if op.name == "stablehlo.broadcast_in_dim":
        result = [()] * len(shape)
        for d, r in enumerate(op.attrs["broadcast_dimensions"]):
            if layout[d] and dims[d] != shape[r]:
                return None
            result[r] = layout[d]
        return tuple(result)
    if op.name == "stablehlo.reshape":
        def starts(sizes):
            out, total = {}, 1
            for d in range(len(sizes) - 1, -1, -1):  # offset of each dim from the minor end
                out[d] = (total, sizes[d])
                total *= sizes[d]
            return out
        kept = {key: r for r, key in starts(shape).items()}
        result = [()] * len(shape)
        for d, key in starts(dims).items():
            if layout[d]:
                if key not in kept:
                    return None
                result[kept[key]] = layout[d]
        return tuple(result)
    return None
