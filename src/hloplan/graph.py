"""The program as plain data: ops, values and their tensor types, in program order.

`ir.extract_graph` builds it from a StableHLO module; the planner reads only this, so op rules,
cost estimates and the problem builder are testable without MLIR.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hloplan.diagnostics import SourceLoc

DTYPE_BYTES = {
    "i1": 1, "pred": 1, "i4": 1, "ui4": 1, "i8": 1, "ui8": 1, "i16": 2, "ui16": 2, "i32": 4,
    "ui32": 4, "i64": 8, "ui64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8,
    "complex<f32>": 8, "complex<f64>": 16,
}


# Which arguments a plan donates (extract-graph's `donate`, `hloplan compile --donate`).
DONATE_CHOICES = ("export", "state", "none")


def dtype_bytes(dtype: str) -> int:
    if dtype in DTYPE_BYTES:
        return DTYPE_BYTES[dtype]
    if dtype.startswith("f8") or dtype.startswith("f4") or dtype.startswith("f6"):
        return 1
    return 4


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: str

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def elements(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def itemsize(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.elements * self.itemsize

    def __str__(self) -> str:
        return f"tensor<{'x'.join(map(str, self.shape))}{'x' if self.shape else ''}{self.dtype}>"


@dataclass
class Value:
    id: int
    type: TensorType | None  # None for non-tensor values (tokens, tuples)
    producer: int  # op index that defines it
    result_index: int
    users: list[int] = field(default_factory=list)  # op indices, program order


@dataclass
class Op:
    index: int
    name: str  # "stablehlo.dot_general", or a pseudo op: "arg", "while.carry", "case.result"
    operands: tuple[int, ...]  # value ids
    results: tuple[int, ...]  # value ids
    attrs: dict = field(default_factory=dict)  # plain Python data from the MLIR attributes
    location: SourceLoc | None = None
    label: str = ""  # the op's name in the user's program, e.g. "jit(step)/dot_general"
    multiplier: float = 1.0  # times it runs per step (loop trip counts)
    parent: int | None = None  # enclosing while/case op, if any
    region: int = 0  # which region of the parent
    # Ops planned as one decision share their strategies (e.g. while carries).
    planned: bool = True

    def describe(self) -> str:
        where = f" at {self.location}" if self.location else ""
        return f"{self.name}{where}"


@dataclass
class Graph:
    ops: list[Op] = field(default_factory=list)
    values: list[Value] = field(default_factory=list)
    arguments: list[int] = field(default_factory=list)  # value ids of main's arguments
    outputs: list[int] = field(default_factory=list)  # value ids returned by main
    argument_names: list[str] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)
    name: str = "main"
    # Arguments the caller donates (jax.jit(..., donate_argnums=...), recorded by jax.export):
    # position -> the output index whose buffer it becomes (tf.aliasing_output), or None
    # (jax.buffer_donor: XLA pairs it with an output of its type).
    donated: dict[int, int | None] = field(default_factory=dict)

    def add_value(self, type_: TensorType | None, producer: int, result_index: int) -> int:
        value = Value(len(self.values), type_, producer, result_index)
        self.values.append(value)
        return value.id

    def add_op(self, name: str, operands: tuple[int, ...], result_types: list[TensorType | None],
               **kwargs) -> Op:
        index = len(self.ops)
        results = tuple(self.add_value(t, index, i) for i, t in enumerate(result_types))
        op = Op(index, name, tuple(operands), results, **kwargs)
        self.ops.append(op)
        for value_id in operands:
            self.values[value_id].users.append(index)
        return op

    def type_of(self, value_id: int) -> TensorType | None:
        return self.values[value_id].type

    def output_aliases(self) -> dict[int, int]:
        """Output index -> the donated argument position whose buffer it is written into. A
        donor without a named output takes the first output of its type not yet taken, in
        order, as XLA pairs them."""
        aliases = {out: arg for arg, out in self.donated.items()
                   if out is not None and 0 <= out < len(self.outputs)}
        for arg, out in sorted(self.donated.items()):
            if out is not None or arg >= len(self.arguments):
                continue
            type_ = self.type_of(self.arguments[arg])
            match = next((k for k, v in enumerate(self.outputs)
                          if k not in aliases and self.type_of(v) == type_), None)
            if match is not None:
                aliases[match] = arg
        return aliases

    def producer(self, value_id: int) -> Op:
        return self.ops[self.values[value_id].producer]
