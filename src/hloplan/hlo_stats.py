"""Measure what XLA actually compiled: collectives and memory of a partitioned HLO module.

The planner predicts which collectives a sharding needs; this module reads the per-device HLO
text that XLA produced after SPMD partitioning (`jax.jit(f).lower(...).compile().as_text()`) and
lists the collectives it really contains, with their sizes, replica-group sizes, the mesh axes the
groups span and how many times each runs per step (collectives inside a while body run once per
iteration).

Entry points:

* `collective_stats(hlo_text, num_devices=..., mesh_axes=...)` -> `CollectiveStats`
* `memory_stats(compiled)` -> dict of `compiled.memory_analysis()` byte counts
* `preallocated_temp_bytes(text)` (`dumped_temp_bytes(dir)`), `live_range_peak(text)`: XLA's
  buffer-assignment and live-range dumps
* `scheduled_overlap(text, kernel_seconds, collective_seconds)`: how much of each asynchronous
  collective the kernels scheduled between its start and its done hide
* `parse_replica_groups(text, num_devices=...)` and `shape_bytes(shape)` are exposed for reuse.

Device ids in replica groups are the SPMD partition ids, i.e. positions in the mesh's row-major
device order (`mesh.devices.flat`), not `jax.Device.id`; `mesh_axes` is interpreted that way.

Per-device bytes (`CollectiveOp.bytes_sent`) follow the ring algorithm, with S the per-device
operand bytes (result bytes for all-gather) and n the group size:
all-reduce 2(n-1)/n*S, all-gather (n-1)/n*S_result, reduce-scatter and all-to-all (n-1)/n*S,
collective-permute and collective-broadcast S.

An all-reduce whose result is only ever read through a 1/n dynamic-slice (the partitioner's form
of "reduce, then keep my shard") is counted as a reduce-scatter, as XLA's GPU and TPU pipelines
rewrite it (ReduceScatterCreator); the CPU pipeline, which these measurements often come from,
keeps the all-reduce. `collective_stats(..., fold_reduce_scatter=False)` counts it as compiled.
A combined (tuple) all-reduce is split: its scattered elements become one reduce-scatter entry.

TPU HLO (libtpu): collectives sit inside fusions (reached through `calls=`), async ones as an
AsyncCollectiveStart / AsyncCollectiveDone pair of fusions whose done half repeats the
collective (counted once, at the start); replica groups print in the iota and `mesh[...]`
forms; all-gathers of sharded weights are often partly collective-permutes, counted as such.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

__all__ = [
    "COLLECTIVE_KINDS",
    "CollectiveOp",
    "CollectiveStats",
    "collective_stats",
    "memory_stats",
    "parse_replica_groups",
    "scheduled_overlap",
    "shape_bytes",
]

COLLECTIVE_KINDS: tuple[str, ...] = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
)

# Opcode -> (kind, is_async). `-done` halves are not listed: an async pair is counted at `-start`.
_OPCODES: dict[str, tuple[str, bool]] = {k: (k, False) for k in COLLECTIVE_KINDS}
_OPCODES.update(
    {
        "all-reduce-start": ("all-reduce", True),
        "all-gather-start": ("all-gather", True),
        "collective-permute-start": ("collective-permute", True),
    }
)

# Bits per element of each HLO primitive type.
_ELEMENT_BITS: dict[str, int] = {
    "pred": 8,
    "s1": 1,
    "u1": 1,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
    "opaque": 0,
}


def _element_bits(dtype: str) -> int:
    dtype = dtype.lower()
    if dtype in _ELEMENT_BITS:
        return _ELEMENT_BITS[dtype]
    if dtype.startswith("f8"):  # f8e4m3fn, f8e5m2, f8e4m3fnuz, f8e8m0fnu, ...
        return 8
    if dtype.startswith("f6"):
        return 6
    if dtype.startswith("f4"):
        return 4
    raise ValueError(f"unknown HLO element type {dtype!r}")


# ---------------------------------------------------------------------------------------------
# Shapes


_ARRAY_SHAPE_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", text)


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside (), [], {} and quotes."""
    parts: list[str] = []
    depth = 0
    quote = ""
    start = 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote and text[i - 1] != "\\":
                quote = ""
            continue
        if ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _tuple_elements(shape: str) -> list[str] | None:
    """The top-level element shapes of a tuple shape string, or None for an array shape."""
    shape = _strip_comments(shape).strip()
    if not shape.startswith("("):
        return None
    return _split_top_level(shape[1:-1])


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string: `f32[16,32]{1,0}`, `bf16[]`, `(s32[], f32[8])`, `token[]`.

    Tuples sum their elements; dynamic dimensions (`<=16`) count at their bound; sub-byte types
    are rounded up to whole bytes per array.
    """
    shape = _strip_comments(shape).strip()
    elements = _tuple_elements(shape)
    if elements is not None:
        return sum(shape_bytes(e) for e in elements)
    m = _ARRAY_SHAPE_RE.match(shape)
    if m is None:
        if shape in ("token", "token[]"):
            return 0
        raise ValueError(f"cannot parse HLO shape {shape!r}")
    dims = [d.strip().lstrip("<=").strip() for d in m.group(2).split(",") if d.strip()]
    count = math.prod(int(d) for d in dims)
    return (count * _element_bits(m.group(1)) + 7) // 8


# ---------------------------------------------------------------------------------------------
# Parsing the module text into computations and instructions


@dataclass(frozen=True)
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]  # operand names (without %), or literal text for constants
    operand_shapes: tuple[str | None, ...]  # shapes when the text prints them inline
    attrs: str  # everything after the operand list, metadata removed
    is_root: bool


@dataclass
class _Computation:
    name: str
    is_entry: bool
    instrs: list[_Instr] = field(default_factory=list)
    shapes: dict[str, str] = field(default_factory=dict)

    @property
    def root(self) -> _Instr | None:
        for ins in self.instrs:
            if ins.is_root:
                return ins
        return self.instrs[-1] if self.instrs else None

    def get(self, name: str) -> _Instr | None:
        for ins in self.instrs:
            if ins.name == name:
                return ins
        return None


_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\)\s*->\s*.*?)?\s*\{$")
_INSTR_HEAD_RE = re.compile(r"^(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_NAME_RE = re.compile(r"^[\w.\-]+$")


def _scan_balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at `start` (quotes respected)."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = [pairs[text[start]]]
    quote = ""
    i = start + 1
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            if ch == quote:
                quote = ""
        elif ch == '"':
            quote = ch
        elif ch in pairs:
            stack.append(pairs[ch])
        elif ch in ")]}":
            if not stack or ch != stack[-1]:
                raise ValueError(f"unbalanced brackets in {text!r}")
            stack.pop()
            if not stack:
                return i + 1
        i += 1
    raise ValueError(f"unbalanced brackets in {text!r}")


def _remove_attr(text: str, key: str) -> str:
    """Remove `key={...}` / `key="..."` blocks (e.g. metadata) so they cannot confuse matching."""
    out = text
    while True:
        m = re.search(r",?\s*\b" + re.escape(key) + r"=", out)
        if m is None:
            return out
        j = m.end()
        if j < len(out) and out[j] in "({[":
            end = _scan_balanced(out, j)
        elif j < len(out) and out[j] == '"':
            end = j + 1
            while end < len(out) and out[end] != '"':
                end += 2 if out[end] == "\\" else 1
            end += 1
        else:
            end = j
            while end < len(out) and out[end] not in ", ":
                end += 1
        out = out[: m.start()] + out[end:]


def _parse_instruction(line: str) -> _Instr | None:
    m = _INSTR_HEAD_RE.match(line)
    if m is None:
        return None
    pos = m.end()
    text = line
    if pos >= len(text):
        return None
    # Result shape: a balanced tuple or a single token.
    if text[pos] == "(":
        end = _scan_balanced(text, pos)
    else:
        end = pos
        while end < len(text) and not text[end].isspace():
            end += 1
    shape = text[pos:end]
    rest = text[end:].lstrip()
    om = re.match(r"([\w\-]+)\(", rest)
    if om is None:
        return None
    opcode = om.group(1)
    close = _scan_balanced(rest, om.end() - 1)
    operand_text = _strip_comments(rest[om.end() : close - 1])
    attrs = rest[close:]
    attrs = _remove_attr(attrs, "metadata")
    attrs = _remove_attr(attrs, "frontend_attributes")
    attrs = _remove_attr(attrs, "statistics")
    names: list[str] = []
    shapes: list[str | None] = []
    if opcode == "constant":
        names.append(operand_text.strip())
        shapes.append(None)
    else:
        for tok in _split_top_level(operand_text):
            # Operands print as `%name` or, in older dumps, `f32[8]{0} %name`.
            parts = tok.rsplit(None, 1)
            if len(parts) == 2 and parts[1].lstrip("%") and _NAME_RE.match(parts[1].lstrip("%")):
                shapes.append(parts[0])
                names.append(parts[1].lstrip("%"))
            else:
                shapes.append(None)
                names.append(tok.lstrip("%"))
    return _Instr(
        name=m.group(2),
        shape=shape,
        opcode=opcode,
        operands=tuple(names),
        operand_shapes=tuple(shapes),
        attrs=attrs,
        is_root=bool(m.group(1)),
    )


@dataclass
class _Module:
    computations: dict[str, _Computation]
    entry: str | None
    num_partitions: int | None
    replica_count: int | None


def _parse_module(hlo_text: str) -> _Module:
    comps: dict[str, _Computation] = {}
    entry: str | None = None
    current: _Computation | None = None
    num_partitions = replica_count = None
    for raw in hlo_text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("HloModule"):
            if m := re.search(r"\bnum_partitions=(\d+)", line):
                num_partitions = int(m.group(1))
            if m := re.search(r"\breplica_count=(\d+)", line):
                replica_count = int(m.group(1))
            continue
        if current is None:
            hm = _HEADER_RE.match(line)
            if hm is not None and "=" not in line.split("(", 1)[0]:
                current = _Computation(name=hm.group(2), is_entry=bool(hm.group(1)))
                comps[current.name] = current
                if current.is_entry:
                    entry = current.name
            continue
        if line == "}":
            current = None
            continue
        ins = _parse_instruction(line)
        if ins is None:
            continue
        current.instrs.append(ins)
        current.shapes[ins.name] = ins.shape
    return _Module(comps, entry, num_partitions, replica_count)


# ---------------------------------------------------------------------------------------------
# Replica groups


def _int_list(text: str) -> list[int]:
    return [int(t) for t in text.replace(" ", "").split(",") if t]


def _iota_array(reshape_dims: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    arr = np.arange(math.prod(reshape_dims), dtype=np.int64).reshape(tuple(reshape_dims))
    if perm is not None:
        arr = arr.transpose(tuple(perm))
    return arr.reshape(-1)


_IOTA_RE = re.compile(r"^\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?$")
_MESH_RE = re.compile(
    r"^mesh\[(?P<axes>[^\]]*)\]"
    r"(?:\s*,\s*device_ids=\((?P<ids>[^()]*(?:\([^()]*\))?[^()]*)\))?"
    r"\s*\{(?P<refs>[^}]*)\}$"
)
_MESH_AXIS_RE = re.compile(r"^'?([^'=]+?)'?\s*=\s*(\d+)$")
_AXIS_REF_RE = re.compile(r"^'?([^':]+?)'?(?::\((\d+)\)(\d+))?$")


def _mesh_groups(m: re.Match[str]) -> np.ndarray:
    """Replica groups of the mesh form `mesh['a'=2,'b'=4], device_ids=(...) {'b'}`."""
    names: list[str] = []
    sizes: list[int] = []
    for tok in _split_top_level(m.group("axes")):
        am = _MESH_AXIS_RE.match(tok)
        if am is None:
            raise ValueError(f"cannot parse mesh axis {tok!r}")
        names.append(am.group(1))
        sizes.append(int(am.group(2)))
    total = math.prod(sizes)
    ids_text = (m.group("ids") or "").strip()
    if not ids_text:
        devices = np.arange(total, dtype=np.int64)
    elif ids_text.startswith("["):
        im = re.match(r"^\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?$", ids_text)
        if im is None:
            raise ValueError(f"cannot parse mesh device_ids {ids_text!r}")
        perm = _int_list(im.group(2)) if im.group(2) else None
        devices = _iota_array(_int_list(im.group(1)), perm)
    else:
        devices = np.array(_int_list(ids_text), dtype=np.int64)
    if devices.size != total:
        raise ValueError(f"mesh device_ids has {devices.size} ids for {total} devices")

    # Axis refs, each a full axis or a sub-axis `name:(pre_size)size`.
    refs: list[tuple[int, int, int | None]] = []  # (mesh dim, pre_size, size) ; size None = full
    for tok in _split_top_level(m.group("refs")):
        rm = _AXIS_REF_RE.match(tok)
        if rm is None or rm.group(1) not in names:
            raise ValueError(f"cannot parse mesh axis ref {tok!r}")
        dim = names.index(rm.group(1))
        if rm.group(2) is None:
            refs.append((dim, 1, None))
        else:
            refs.append((dim, int(rm.group(2)), int(rm.group(3))))

    # Split each referenced mesh dim into sub-dims so every ref is one whole (sub-)dim, then move
    # the referenced sub-dims (in ref order) to the end.
    new_sizes: list[int] = []
    ref_index: dict[int, int] = {}
    for dim, size in enumerate(sizes):
        dim_refs = [(i, r) for i, r in enumerate(refs) if r[0] == dim]
        if not dim_refs:
            new_sizes.append(size)
            continue
        if any(r[2] is None for _, r in dim_refs):
            ref_index[dim_refs[0][0]] = len(new_sizes)
            new_sizes.append(size)
            continue
        prefix = 1
        for i, (_, pre, sub) in sorted(dim_refs, key=lambda t: t[1][1]):
            assert sub is not None
            if pre != prefix:
                new_sizes.append(pre // prefix)
                prefix = pre
            ref_index[i] = len(new_sizes)
            new_sizes.append(sub)
            prefix *= sub
        if prefix != size:
            new_sizes.append(size // prefix)
    grouped = [ref_index[i] for i in range(len(refs))]
    order = [d for d in range(len(new_sizes)) if d not in grouped] + grouped
    group_size = math.prod(new_sizes[d] for d in grouped)
    arr = devices.reshape(tuple(new_sizes)).transpose(tuple(order))
    return arr.reshape(-1, group_size)


def parse_replica_groups(text: str, *, num_devices: int | None = None) -> np.ndarray | None:
    """Replica groups as a (num_groups, group_size) int array.

    Accepts the explicit form `{{0,1},{2,3}}`, the iota forms `[2,4]<=[8]` and
    `[4,2]<=[2,4]T(1,0)`, and the mesh form `mesh['x'=2,'y'=4], device_ids=([2,4]T(1,0)) {'y'}`.
    `{}` means one group of all devices: returns that group when `num_devices` is known, else None.
    """
    text = text.strip()
    if text.startswith("{"):
        inner = text[1:-1].strip()
        if not inner:
            if num_devices is None:
                return None
            return np.arange(num_devices, dtype=np.int64).reshape(1, -1)
        groups = [_int_list(g.strip()[1:-1]) for g in _split_top_level(inner)]
        if len({len(g) for g in groups}) > 1:
            # Ragged groups are legal HLO; pad with -1 so the array stays rectangular.
            width = max(len(g) for g in groups)
            groups = [g + [-1] * (width - len(g)) for g in groups]
        return np.array(groups, dtype=np.int64).reshape(len(groups), -1)
    if m := _IOTA_RE.match(text):
        dims = _int_list(m.group(1))
        perm = _int_list(m.group(3)) if m.group(3) else None
        arr = _iota_array(_int_list(m.group(2)), perm)
        if len(dims) != 2:
            raise ValueError(f"iota replica groups must have 2 dims: {text!r}")
        return arr.reshape(dims[0], dims[1])
    if m := _MESH_RE.match(text):
        return _mesh_groups(m)
    raise ValueError(f"cannot parse replica groups {text!r}")


def _extract_replica_groups(attrs: str) -> str | None:
    m = re.search(r"\breplica_groups=", attrs)
    if m is None:
        return None
    i = m.end()
    if attrs.startswith("{", i):
        return attrs[i : _scan_balanced(attrs, i)]
    if attrs.startswith("[", i):
        im = re.match(r"\[[\d,\s]+\]<=\[[\d,\s]+\](?:T\([\d,\s]+\))?", attrs[i:])
        if im is None:
            raise ValueError(f"cannot parse replica groups in {attrs!r}")
        return im.group(0)
    if attrs.startswith("mesh[", i):
        j = _scan_balanced(attrs, i + 4)
        dm = re.match(r"\s*,\s*device_ids=", attrs[j:])
        if dm is not None:
            j = _scan_balanced(attrs, j + dm.end())
        bm = re.match(r"\s*\{", attrs[j:])
        if bm is None:
            raise ValueError(f"cannot parse mesh replica groups in {attrs!r}")
        j = _scan_balanced(attrs, j + bm.end() - 1)
        return attrs[i:j]
    raise ValueError(f"cannot parse replica groups in {attrs!r}")


def _axes_of_groups(groups: np.ndarray, mesh_axes: Sequence[tuple[str, int]]) -> tuple[str, ...]:
    """Mesh axes spanned by every group (major to minor in group order); for groups that split
    the mesh into equal parts of a product of axes, the axes they vary over (mesh order); else ().

    XLA's partitioner moves a dim's shards to another dim when their device orders differ by an
    all-to-all over parts of axes and a collective-permute (libtpu on v5e:2x4: groups
    {0,1},{2,3},{4,5},{6,7}, halves of y); such groups travel on those axes' links.
    """
    sizes = [s for _, s in mesh_axes]
    total = math.prod(sizes)
    if groups.size == 0 or groups.min() < 0 or groups.max() >= total:
        return ()
    if groups.shape[1] == 1:
        return ()
    coords = np.stack(np.unravel_index(groups, tuple(sizes)), axis=-1)  # (G, n, ndims)
    varying = [d for d in range(len(sizes)) if (coords[:, :, d] != coords[:, :1, d]).any()]
    part_of = math.prod(sizes[d] for d in varying)
    if (part_of > groups.shape[1] and part_of % groups.shape[1] == 0
            and groups.shape[0] * groups.shape[1] == total
            and len(np.unique(groups)) == total):
        return tuple(mesh_axes[d][0] for d in varying)  # parts, covering every device once
    if math.prod(sizes[d] for d in varying) != groups.shape[1]:
        return ()
    # Every group must be the full product of the varying axes (no repeats).
    for g in coords:
        if len({tuple(c) for c in g[:, varying]}) != groups.shape[1]:
            return ()

    # Order: the axis that changes latest along the group listing is the most major one.
    def first_change(d: int) -> int:
        col = coords[0, :, d]
        return int(np.argmax(col != col[0]))

    ordered = sorted(varying, key=first_change, reverse=True)
    return tuple(mesh_axes[d][0] for d in ordered)


def _axes_of_pairs(
    pairs: Sequence[tuple[int, int]], mesh_axes: Sequence[tuple[str, int]]
) -> tuple[str, ...]:
    sizes = tuple(s for _, s in mesh_axes)
    total = math.prod(sizes)
    axes: set[int] = set()
    for src, dst in pairs:
        if not (0 <= src < total and 0 <= dst < total):
            return ()
        a = np.unravel_index(src, sizes)
        b = np.unravel_index(dst, sizes)
        axes.update(d for d in range(len(sizes)) if a[d] != b[d])
    return tuple(mesh_axes[d][0] for d in sorted(axes))


# ---------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of the compiled module.

    `bytes_sent` is per device and per execution; `trip_count` is how many times it runs per step
    (product of the trip counts of the while loops around it). `trip_count_known` is False when
    some enclosing loop's trip count could not be determined (it then counts as 1).
    For collective-permute, `group_size` is 2 and `replica_groups` holds the source-target pairs.
    """

    kind: str
    name: str
    computation: str
    shape: str
    result_bytes: int
    operand_bytes: int
    group_size: int
    num_groups: int
    axes: tuple[str, ...]
    bytes_sent: float
    trip_count: int = 1
    trip_count_known: bool = True
    is_async: bool = False
    replica_groups: tuple[tuple[int, ...], ...] | None = None

    @property
    def total_bytes_sent(self) -> float:
        """Per-device bytes over one step: `bytes_sent * trip_count`."""
        return self.bytes_sent * self.trip_count


@dataclass(frozen=True)
class CollectiveStats:
    ops: tuple[CollectiveOp, ...]
    num_devices: int | None = None

    def by_kind(self) -> dict[str, tuple[int, float]]:
        """kind -> (executions per step, per-device bytes per step); loops multiply both."""
        out: dict[str, tuple[int, float]] = {}
        for op in self.ops:
            count, nbytes = out.get(op.kind, (0, 0.0))
            out[op.kind] = (count + op.trip_count, nbytes + op.total_bytes_sent)
        return out

    @property
    def total_bytes(self) -> float:
        """Per-device bytes sent over one step by all collectives."""
        return sum(op.total_bytes_sent for op in self.ops)

    @property
    def count(self) -> int:
        """Collective executions per step."""
        return sum(op.trip_count for op in self.ops)

    @property
    def all_trip_counts_known(self) -> bool:
        return all(op.trip_count_known for op in self.ops)

    def of_kind(self, kind: str) -> tuple[CollectiveOp, ...]:
        return tuple(op for op in self.ops if op.kind == kind)


# ---------------------------------------------------------------------------------------------
# Call graph and trip counts


_CALL_ATTRS = ("calls", "to_apply", "true_computation", "false_computation")


def _callees(ins: _Instr) -> list[str]:
    names: list[str] = []
    if ins.opcode in ("async-done", "async-update"):
        return names  # same computation as the async-start; count once
    for key in _CALL_ATTRS:
        for m in re.finditer(r"\b" + key + r"=%?([\w.\-]+)", ins.attrs):
            names.append(m.group(1))
    for key in ("branch_computations", "called_computations"):
        m = re.search(r"\b" + key + r"=\{([^}]*)\}", ins.attrs)
        if m:
            names.extend(t.strip().lstrip("%") for t in m.group(1).split(",") if t.strip())
    return names


def _known_trip_count(attrs: str) -> int | None:
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?', attrs)
    return int(m.group(1)) if m else None


def _through_copies(comp: _Computation, name: str) -> _Instr | None:
    """The instruction `name` refers to, looking through up to 8 copies, bitcasts, reshapes and
    converts."""
    ins = comp.get(name)
    seen = 0
    while ins is not None and ins.opcode in ("copy", "bitcast", "reshape", "convert") and seen < 8:
        ins = comp.get(ins.operands[0])
        seen += 1
    return ins


def _constant_value(comp: _Computation, name: str) -> int | None:
    ins = _through_copies(comp, name)
    if ins is None or ins.opcode != "constant":
        return None
    text = ins.operands[0].strip().strip("{}").strip()
    try:
        return int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            return None
        return int(value) if value.is_integer() else None


def _gte_index(comp: _Computation, name: str) -> int | None:
    ins = _through_copies(comp, name)
    if ins is None or ins.opcode != "get-tuple-element":
        return None
    m = re.search(r"\bindex=(\d+)", ins.attrs)
    return int(m.group(1)) if m else None


_FLIP = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "EQ": "EQ", "NE": "NE"}


def _trip_count_from_condition(
    module: _Module, caller: _Computation, while_ins: _Instr, cond_name: str
) -> int | None:
    """Trip count of `i < c`-style loops: the condition compares the induction variable (a
    tuple element of the loop state) with a constant; init comes from the while's operand tuple
    (0 if it cannot be found); the step from the body's update of that element (1 if it is not
    `i + constant`: XLA's TPU compiler unrolls its collective-matmul loops by two, i += 2)."""
    cond = module.computations.get(cond_name)
    if cond is None or cond.root is None:
        return None
    root = cond.root
    operands: list[tuple[_Computation, str]] = [(cond, o) for o in root.operands]
    compare = root
    if root.opcode == "fusion":
        callees = _callees(root)
        fused = module.computations.get(callees[0]) if callees else None
        if fused is None or fused.root is None or fused.root.opcode != "compare":
            return None
        compare = fused.root
        mapped: list[tuple[_Computation, str]] = []
        for o in compare.operands:
            p = fused.get(o)
            pm = (
                re.fullmatch(r"\s*(\d+)\s*", p.operands[0])
                if p and p.opcode == "parameter"
                else None
            )
            if pm is not None and int(pm.group(1)) < len(root.operands):
                mapped.append((cond, root.operands[int(pm.group(1))]))
            else:
                mapped.append((fused, o))
        operands = mapped
    if compare.opcode != "compare" or len(operands) != 2:
        return None
    dm = re.search(r"\bdirection=(\w+)", compare.attrs)
    if dm is None:
        return None
    direction = dm.group(1)
    (ca, a), (cb, b) = operands
    const_b = _constant_value(cb, b)
    const_a = _constant_value(ca, a)
    if const_b is not None and const_a is None:
        index, limit = _gte_index(ca, a), const_b
    elif const_a is not None and const_b is None:
        index, limit = _gte_index(cb, b), const_a
        direction = _FLIP[direction]
    else:
        return None
    init = None
    if index is not None and while_ins.operands:
        state = caller.get(while_ins.operands[0])
        if state is not None and state.opcode == "tuple" and index < len(state.operands):
            init = _constant_value(caller, state.operands[index])
    step = _loop_step(module, while_ins, index) if index is not None else None
    step = step if step and step > 0 else 1
    if direction in ("LT", "NE"):
        return -(-max(0, limit - (init or 0)) // step)
    if direction == "LE":
        return -(-max(0, limit - (init or 0) + 1) // step)
    if init is not None and direction == "GT":
        return max(0, init - limit)
    if init is not None and direction == "GE":
        return max(0, init - limit + 1)
    return None


def _loop_step(module: _Module, while_ins: _Instr, index: int) -> int | None:
    """The constant a while body adds to loop-state element `index` (None if it does not)."""
    body_name = re.search(r"\bbody=%?([\w.\-]+)", while_ins.attrs)
    body = module.computations.get(body_name.group(1)) if body_name else None
    root = body.root if body is not None else None
    if root is None or root.opcode != "tuple" or index >= len(root.operands):
        return None
    update = _through_copies(body, root.operands[index])
    if update is None or update.opcode != "add" or len(update.operands) != 2:
        return None
    a, b = update.operands
    for var, const in ((a, b), (b, a)):
        if _gte_index(body, var) == index:
            return _constant_value(body, const)
    return None


def _multipliers(module: _Module) -> dict[str, tuple[int, bool]]:
    """computation -> (executions per step, all enclosing trip counts known)."""
    edges: dict[str, list[tuple[str, int, bool]]] = {}
    called: set[str] = set()
    for comp in module.computations.values():
        out: list[tuple[str, int, bool]] = []
        for ins in comp.instrs:
            if ins.opcode == "while":
                body = re.search(r"\bbody=%?([\w.\-]+)", ins.attrs)
                cond = re.search(r"\bcondition=%?([\w.\-]+)", ins.attrs)
                trip = _known_trip_count(ins.attrs)
                if trip is None and cond is not None:
                    trip = _trip_count_from_condition(module, comp, ins, cond.group(1))
                known = trip is not None
                trip = trip if trip is not None else 1
                if body:
                    out.append((body.group(1), trip, known))
                if cond:
                    out.append((cond.group(1), trip + 1 if known else 1, known))
                continue
            for callee in _callees(ins):
                out.append((callee, 1, True))
        out = [e for e in out if e[0] in module.computations]
        edges[comp.name] = out
        called.update(e[0] for e in out)

    roots = [module.entry] if module.entry else [c for c in module.computations if c not in called]
    # Topological order (reverse DFS post-order) over computations reachable from the roots.
    order: list[str] = []
    visited: set[str] = set()
    for root in roots:
        stack: list[tuple[str, int]] = [(root, 0)]
        while stack:
            name, i = stack.pop()
            if i == 0:
                if name in visited:
                    continue
                visited.add(name)
            succ = edges.get(name, [])
            if i < len(succ):
                stack.append((name, i + 1))
                if succ[i][0] not in visited:
                    stack.append((succ[i][0], 0))
            else:
                order.append(name)
    order.reverse()
    mult: dict[str, int] = {r: 1 for r in roots}
    known: dict[str, bool] = {r: True for r in roots}
    for name in order:
        m, k = mult.get(name, 0), known.get(name, True)
        for callee, factor, edge_known in edges.get(name, []):
            mult[callee] = mult.get(callee, 0) + m * factor
            known[callee] = known.get(callee, True) and k and edge_known
    return {n: (mult.get(n, 0), known.get(n, True)) for n in order}


# ---------------------------------------------------------------------------------------------
# Collectives


def _operand_bytes(comp: _Computation, ins: _Instr) -> int | None:
    total = 0
    for name, inline in zip(ins.operands, ins.operand_shapes, strict=True):
        shape = inline or comp.shapes.get(name)
        if shape is None:
            return None
        total += shape_bytes(shape)
    return total


def _ring_bytes(kind: str, n: int, operand: int, result: int) -> float:
    if kind in ("collective-permute", "collective-broadcast"):
        return float(operand)
    if n <= 1:
        return 0.0
    frac = (n - 1) / n
    if kind == "all-reduce":
        return 2 * frac * operand
    if kind == "all-gather":
        return frac * result
    return frac * operand  # reduce-scatter, all-to-all


def _collective(
    comp: _Computation,
    ins: _Instr,
    kind: str,
    is_async: bool,
    num_devices: int | None,
    mesh_axes: Sequence[tuple[str, int]] | None,
    trip: int,
    known: bool,
) -> CollectiveOp:
    # Result bytes. Async starts return tuples: all-gather-start (in, out),
    # collective-permute-start (in, out, u32[], u32[]); all-reduce-start returns the result.
    result_shape = ins.shape
    elements = _tuple_elements(result_shape)
    if (
        is_async
        and kind in ("all-gather", "collective-permute")
        and elements
        and len(elements) >= 2
    ):
        result_bytes = shape_bytes(elements[1])
    else:
        result_bytes = shape_bytes(result_shape)

    groups: np.ndarray | None = None
    pairs: list[tuple[int, int]] | None = None
    if kind == "collective-permute":
        pm = re.search(r"\bsource_target_pairs=", ins.attrs)
        if pm is not None:
            j = _scan_balanced(ins.attrs, pm.end())
            inner = ins.attrs[pm.end() + 1 : j - 1]
            pairs = []
            for p in _split_top_level(inner):
                src, dst = _int_list(p.strip()[1:-1])
                pairs.append((src, dst))
        n = 2
        num_groups = len(pairs) if pairs is not None else 0
    else:
        rg = _extract_replica_groups(ins.attrs)
        groups = parse_replica_groups(rg if rg is not None else "{}", num_devices=num_devices)
        if groups is None:
            n, num_groups = (num_devices or 1), 1
        else:
            n = int((groups[0] >= 0).sum())
            num_groups = groups.shape[0]

    operand_bytes = _operand_bytes(comp, ins)
    if operand_bytes is None:  # infer from the result when an operand shape is unknown
        if kind == "all-gather":
            operand_bytes = result_bytes // max(n, 1)
        elif kind == "reduce-scatter":
            operand_bytes = result_bytes * n
        else:
            operand_bytes = result_bytes

    axes: tuple[str, ...] = ()
    if mesh_axes:
        if pairs is not None:
            axes = _axes_of_pairs(pairs, mesh_axes)
        elif groups is not None and (groups >= 0).all():
            axes = _axes_of_groups(groups, mesh_axes)
    if pairs is not None:
        rg_tuple: tuple[tuple[int, ...], ...] | None = tuple(pairs)
    elif groups is not None:
        rg_tuple = tuple(tuple(int(d) for d in g if d >= 0) for g in groups)
    else:
        rg_tuple = None
    return CollectiveOp(
        kind=kind,
        name=ins.name,
        computation=comp.name,
        shape=result_shape,
        result_bytes=result_bytes,
        operand_bytes=operand_bytes,
        group_size=n,
        num_groups=num_groups,
        axes=axes,
        bytes_sent=_ring_bytes(kind, n, operand_bytes, result_bytes),
        trip_count=trip,
        trip_count_known=known,
        is_async=is_async,
        replica_groups=rg_tuple,
    )


def _elements(shape: str) -> int | None:
    m = re.match(r"\w+\[([\d,]*)\]", shape.strip())
    if m is None:
        return None
    return math.prod(int(d) for d in m.group(1).split(",") if d) if m.group(1) else 1


def _users(comp: _Computation) -> dict[str, list[_Instr]]:
    out: dict[str, list[_Instr]] = {}
    for ins in comp.instrs:
        for name in ins.operands:
            out.setdefault(name, []).append(ins)
    return out


def _only_sliced(module: _Module, comp: _Computation, users: dict[str, list[_Instr]],
                 name: str, elements: int, n: int, depth: int = 0) -> bool:
    """Whether value `name` (of `elements` elements) is read only by dynamic-slices keeping 1/n
    of it (directly, through bitcasts and copies, or inside fusions). Copies include libtpu's
    moves between memory spaces (`copy-start`, then `copy-done` of it): a value kept for the
    backward pass is moved out of VMEM and back, then sliced (HF GPT-2's layer-norm row sums
    on v5e:2x4)."""
    readers = users.get(name, [])
    if not readers or depth > 8:
        return False
    for user in readers:
        if user.opcode == "dynamic-slice" and user.operands[0] == name:
            size = _elements(user.shape)
            if size is None or size * n != elements:
                return False
        elif user.opcode in ("bitcast", "copy", "copy-done"):
            if not _only_sliced(module, comp, users, user.name, elements, n, depth + 1):
                return False
        elif user.opcode == "copy-start":
            # read by its copy-done only (whose result is the moved value)
            done = users.get(user.name, [])
            if not done or any(d.opcode != "copy-done" for d in done):
                return False
            if not _only_sliced(module, comp, users, user.name, elements, n, depth + 1):
                return False
        elif user.opcode == "fusion":
            callee = next(iter(_callees(user)), None)
            fused = module.computations.get(callee) if callee else None
            if fused is None:
                return False
            fused_users = _users(fused)
            for index, operand in enumerate(user.operands):
                if operand != name:
                    continue
                param = next((i for i in fused.instrs if i.opcode == "parameter"
                              and i.operands and i.operands[0].strip() == str(index)), None)
                if param is None or not _only_sliced(module, fused, fused_users, param.name,
                                                     elements, n, depth + 1):
                    return False
        else:
            return False
    return True


def _scattered_elements(module: _Module, comp: _Computation, users: dict[str, list[_Instr]],
                        ins: _Instr, n: int) -> list[int]:
    """Indices of an all-reduce's results (tuple elements, or [0]) read only as 1/n slices."""
    elements = _tuple_elements(ins.shape)
    if elements is None:
        size = _elements(ins.shape)
        ok = size is not None and size % n == 0 and _only_sliced(module, comp, users, ins.name, size, n)
        return [0] if ok else []
    out = []
    by_index: dict[int, list[_Instr]] = {}
    for user in users.get(ins.name, []):
        if user.opcode != "get-tuple-element":
            return []
        m = re.search(r"\bindex=(\d+)", user.attrs)
        if m is None:
            return []
        by_index.setdefault(int(m.group(1)), []).append(user)
    for k, shape in enumerate(elements):
        size = _elements(shape)
        gtes = by_index.get(k, [])
        if (size and size % n == 0 and gtes
                and all(_only_sliced(module, comp, users, g.name, size, n) for g in gtes)):
            out.append(k)
    return out


def _split_reduce_scatter(comp: _Computation, op: CollectiveOp, ins: _Instr,
                          scattered: list[int]) -> list[CollectiveOp]:
    """An all-reduce as compiled -> [remaining all-reduce?, reduce-scatter of the sliced part].
    Each part is sized by its operands, as a whole all-reduce is (operand_bytes): libtpu's
    all-reduce can take f32 operands and give bf16 results (a convert to the MXU's input dtype
    folded into it), so the sliced results' bytes taken from the operands' would leave a
    spurious remainder of the difference."""
    elements = _tuple_elements(ins.shape) or [ins.shape]
    sizes = [shape_bytes(shape) for shape in elements]
    if len(ins.operands) == len(elements):
        operands = [inline or comp.shapes.get(name)
                    for name, inline in zip(ins.operands, ins.operand_shapes, strict=True)]
        if all(operands):
            sizes = [shape_bytes(shape) for shape in operands]
    part = sum(sizes[k] for k in scattered)
    rest = sum(size for k, size in enumerate(sizes) if k not in scattered)
    n = op.group_size
    scatter = replace(
        op, kind="reduce-scatter", name=op.name + " (reduce-scatter part)"
        if rest else op.name, operand_bytes=part, result_bytes=part // max(n, 1),
        bytes_sent=_ring_bytes("reduce-scatter", n, part, part // max(n, 1)))
    if not rest:
        return [scatter]
    remaining = replace(op, operand_bytes=rest, result_bytes=rest,
                                    bytes_sent=_ring_bytes("all-reduce", n, rest, rest))
    return [remaining, scatter]


_CHANNEL = re.compile(r"\bchannel_id=(\d+)")


def _is_async_collective_done(comp: _Computation) -> bool:
    """XLA's TPU pipeline runs a collective asynchronously as two fusions: the start's fused
    computation holds the collective under a custom-call AsyncCollectiveStart, the done's holds
    a copy of it (same channel) under AsyncCollectiveDone. The copy is not a second collective."""
    root = comp.root
    return (root is not None and root.opcode == "custom-call"
            and 'custom_call_target="AsyncCollectiveDone"' in root.attrs)


def _is_async_collective_start(comp: _Computation) -> bool:
    root = comp.root
    return (root is not None and root.opcode == "custom-call"
            and 'custom_call_target="AsyncCollectiveStart"' in root.attrs)


def collective_stats(
    hlo_text: str,
    *,
    num_devices: int | None = None,
    mesh_axes: Sequence[tuple[str, int]] | None = None,
    fold_reduce_scatter: bool = True,
) -> CollectiveStats:
    """The collectives in a compiled (post-SPMD) HLO module's text, with per-device byte counts.

    `num_devices` resolves `replica_groups={}` (all devices); it defaults to the module header's
    `num_partitions` (times `replica_count`), or the mesh size. `mesh_axes` (name, size) pairs in
    row-major device order let each op report which mesh axes its groups span.
    Computations unreachable from the entry are ignored; ops in while bodies are multiplied by
    the loop trip count (from `known_trip_count` in the backend config, else from the loop
    condition), calls and conditional branches count once. `fold_reduce_scatter`: count an
    all-reduce read only through 1/n slices as the reduce-scatter GPU/TPU XLA makes of it.
    """
    module = _parse_module(hlo_text)
    if num_devices is None:
        if module.num_partitions is not None or module.replica_count is not None:
            num_devices = (module.num_partitions or 1) * (module.replica_count or 1)
        elif mesh_axes:
            num_devices = math.prod(s for _, s in mesh_axes)
    mesh = tuple((str(a), int(s)) for a, s in mesh_axes) if mesh_axes else None
    multipliers = _multipliers(module)
    ops: list[CollectiveOp] = []
    channels: set[tuple[str, str]] = set()
    # Channels of collectives whose async start is found: counted there, with the start's
    # executions per step (a continuation may sit in a loop body the collective spans).
    started: set[tuple[str, str]] = set()
    for comp_name in multipliers:
        comp = module.computations[comp_name]
        if _is_async_collective_start(comp):
            for ins in comp.instrs:
                channel = _CHANNEL.search(ins.attrs)
                if ins.opcode in _OPCODES and channel is not None:
                    started.add((_OPCODES[ins.opcode][0], channel.group(1)))
    for comp_name, (mult, known) in multipliers.items():
        comp = module.computations[comp_name]
        if _is_async_collective_done(comp):
            continue
        users = _users(comp) if fold_reduce_scatter else {}
        for ins in comp.instrs:
            spec = _OPCODES.get(ins.opcode)
            if spec is None:
                continue
            kind, is_async = spec
            # An asynchronous collective that XLA's TPU pipeline overlaps with several compute
            # fusions appears in each of them (the start's, then continuation fusions that
            # each hold a copy of it with the same channel): one collective.
            channel = _CHANNEL.search(ins.attrs)
            if channel is not None and "async_collective_fusion_config" in ins.attrs:
                key = (kind, channel.group(1))
                if key in started:
                    if not _is_async_collective_start(comp):
                        continue
                elif key in channels:
                    continue
                channels.add(key)
            op = _collective(comp, ins, kind, is_async, num_devices, mesh, mult, known)
            if fold_reduce_scatter and kind == "all-reduce" and not is_async and op.group_size > 1:
                scattered = _scattered_elements(module, comp, users, ins, op.group_size)
                if scattered:
                    ops.extend(_split_reduce_scatter(comp, op, ins, scattered))
                    continue
            ops.append(op)
    return CollectiveStats(ops=tuple(ops), num_devices=num_devices)


# ---------------------------------------------------------------------------------------------
# Kernels: a per-kernel roofline of the compiled program

# Instructions that launch no kernel of their own (bookkeeping, control flow; collectives are
# priced by collective_stats).
_NO_KERNEL = {
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional",
    "call", "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
    # Asynchronous copies and slices between memory spaces (TPU prefetches into on-chip
    # memory): DMAs that overlap the kernels (a v5e profile shows them taking no core time).
    "copy-start", "copy-done", "slice-start", "slice-done",
    "send", "send-done", "recv", "recv-done", "async-start",
    "async-update", "async-done", "all-reduce", "all-gather", "reduce-scatter", "all-to-all",
    "collective-permute", "collective-broadcast", "ragged-all-to-all",
    *(f"{_op}-{_phase}" for _op in ("all-reduce", "all-gather", "collective-permute")
      for _phase in ("start", "done")),
}
_READS_PART = {"slice", "dynamic-slice", "gather"}
# Custom calls of XLA's TPU compiler that are layout or bookkeeping, not kernels.
_NO_KERNEL_TARGETS = {"ConcatBitcast", "AssumeGatherIndicesInBound", "AllocateBuffer"}


def _bookkeeping_call(ins: _Instr) -> bool:
    target = re.search(r'custom_call_target="([\w.\-]+)"', ins.attrs)
    return ins.opcode == "custom-call" and target is not None \
        and target.group(1) in _NO_KERNEL_TARGETS


@dataclass(frozen=True)
class KernelStats:
    """Per-kernel roofline of a compiled program: each kernel (a fusion or a lone instruction
    of the entry, a loop body or a branch) takes max(its dot/convolution FLOPs / peak, the bytes
    it reads and writes / HBM bandwidth); kernels run one after another."""

    seconds: float
    kernels: int  # kernel launches per step (loop bodies counted per iteration)
    hbm_bytes: float  # bytes read and written by all kernels per step
    matmul_flops: float  # FLOPs of dots and convolutions per step


def _dims(shape: str) -> list[int]:
    m = _ARRAY_SHAPE_RE.match(_strip_comments(shape).strip())
    if m is None:
        return []
    return [int(d.strip().lstrip("<=").strip()) for d in m.group(2).split(",") if d.strip()]


def _matmul_flops(comp: _Computation, ins: _Instr) -> float:
    out = _elements(ins.shape) or 0
    if ins.opcode == "dot":
        lhs = ins.operand_shapes[0] or comp.shapes.get(ins.operands[0], "")
        m = re.search(r"\blhs_contracting_dims=\{([\d,\s]*)\}", ins.attrs)
        dims = _dims(lhs)
        contracted = math.prod(dims[int(d)] for d in m.group(1).split(",") if d.strip()) \
            if m and dims else 1
        return 2.0 * out * contracted
    if ins.opcode == "convolution":
        lhs = ins.operand_shapes[0] or comp.shapes.get(ins.operands[0], "")
        rhs = ins.operand_shapes[1] or comp.shapes.get(ins.operands[1], "")
        m = re.search(r"\bdim_labels=([^_]*)_([^-]*)->(\w+)", ins.attrs)
        dims = _dims(rhs)
        if not (m and dims and "i" in m.group(2)):
            return 0.0
        # Per output element: input features times the window taps that land on the input
        # rather than in padding. XLA's TPU compiler writes dots as convolutions whose batch
        # dims are windows padded by size - 1 on both sides: most of their taps are padding.
        taps = _valid_taps(_dims(lhs), _dims(ins.shape), m.group(1), m.group(3), ins.attrs)
        if taps is None:
            taps = math.prod(dims[k] for k, c in enumerate(m.group(2)) if c.isdigit())
        return 2.0 * out * dims[m.group(2).index("i")] * taps
    return 0.0


def _valid_taps(lhs: list[int], out: list[int], lhs_labels: str, out_labels: str,
                attrs: str) -> float | None:
    """Mean count, over output positions, of window taps inside the (dilated) input."""
    window = re.search(r"\bwindow=\{([^}]*)\}", attrs)
    fields = dict(re.findall(r"(\w+)=(\S+)", window.group(1))) if window else {}
    if "size" not in fields or len(lhs) != len(lhs_labels) or len(out) != len(out_labels):
        return None

    def per_dim(key: str, default: int) -> list[str]:
        return fields[key].split("x") if key in fields else [str(default)] * len(sizes)

    sizes = [int(v) for v in fields["size"].split("x")]
    pads = [tuple(int(p) for p in v.split("_")) for v in per_dim("pad", 0)] \
        if "pad" in fields else [(0, 0)] * len(sizes)
    strides, lhs_dilate, rhs_dilate = ([int(v) for v in per_dim(k, 1)]
                                       for k in ("stride", "lhs_dilate", "rhs_dilate"))
    from hloplan.op_rules import window_taps

    taps = 1.0
    for d, size in enumerate(sizes):
        if str(d) not in lhs_labels or str(d) not in out_labels:
            return None
        n_in, n_out = lhs[lhs_labels.index(str(d))], out[out_labels.index(str(d))]
        if size == 1:
            continue
        valid = window_taps(n_in, n_out, size, strides[d], pads[d][0], lhs_dilate[d],
                            rhs_dilate[d])
        if valid is None:
            continue
        taps *= valid / max(n_out, 1)
    return taps


def _fused_flops(module: _Module, name: str, seen: set[str]) -> float:
    comp = module.computations.get(name)
    if comp is None or name in seen:
        return 0.0
    seen.add(name)
    total = 0.0
    for ins in comp.instrs:
        total += _matmul_flops(comp, ins)
        for callee in _callees(ins):
            total += _fused_flops(module, callee, seen)
    return total


def _moves_collective_data(ins: _Instr) -> bool:
    """A collective inside a fusion (libtpu's asynchronous collectives: start, done and the
    continuation fusions that overlap one with compute): its buffers move by DMA, priced by
    collective_stats, not by the kernel that hosts it."""
    if ins.opcode == "custom-call":
        return re.search(r'custom_call_target="AsyncCollective', ins.attrs) is not None
    return ins.opcode in _OPCODES or ins.opcode.endswith("-done") and ins.opcode[:-5] in _OPCODES


def _fusion_written_bytes(fused: _Computation | None, shape: str) -> float:
    """Bytes a fusion writes: its result, less the elements of a tuple result that are a
    collective's buffers or a parameter passed through unchanged (continuation fusions)."""
    root = fused.root if fused is not None else None
    if root is None:
        return shape_bytes(shape)
    if _moves_collective_data(root):
        return 0.0
    if root.opcode != "tuple":
        return shape_bytes(shape)
    total = 0.0
    for name in root.operands:
        source = fused.get(name)
        if source is not None and (source.opcode == "parameter" or _moves_collective_data(source)):
            continue
        total += shape_bytes(fused.shapes.get(name, source.shape if source else ""))
    return total


def _fusion_operand_bytes(comp: _Computation, ins: _Instr, fused: _Computation | None,
                          module: _Module | None = None) -> float:
    """Bytes a fusion reads: each operand whole, unless its fused computation `fused` reads it
    only through slices (then the slices; followed into nested fusions given `module`), only
    into a collective's buffers or passes it through to its result (then nothing), or it is the
    buffer a dynamic-update-slice root updates in place (then nothing)."""
    params: dict[int, str] = {}
    if fused is not None:
        for f in fused.instrs:
            if f.opcode == "parameter":
                m = re.match(r"\s*(\d+)", f.operands[0] if f.operands else "")
                if m:
                    params[int(m.group(1))] = f.name
    users = _users(fused) if fused is not None else {}
    root = fused.root if fused is not None else None
    total = 0.0
    for k, (name, inline) in enumerate(zip(ins.operands, ins.operand_shapes, strict=True)):
        shape = inline or comp.shapes.get(name)
        if shape is None:
            continue
        param = params.get(k)
        if (root is not None and root.opcode == "dynamic-update-slice" and root.operands
                and root.operands[0] == param):
            continue
        whole = shape_bytes(shape)
        elements = _elements(shape)
        sliced = _sliced_elements(users, param, root, module=module) if param and elements \
            else None
        if sliced is None:
            total += whole
        else:
            total += min(whole, whole * sliced / elements)
    return total


# One output element per input element: a loop fusion that only slices what they produce
# reads only the sliced elements of their operand.
_PASS_THROUGH = {"bitcast", "copy", "transpose", "reshape", "convert"}


def _sliced_elements(users: dict[str, list[_Instr]], name: str, root: _Instr | None,
                     depth: int = 0, module: _Module | None = None) -> int | None:
    """How many elements of fused value `name` its readers touch, when each reads it through
    a slice (directly, after layout changes, converts or a pad, or inside a nested fusion given
    `module`), or not at all (a collective's buffer, or passed through to a tuple result); None
    if some reader reads it whole (or it is the fusion's result)."""
    readers = users.get(name, [])
    if not readers or depth > 8 or (root is not None and root.name == name):
        return None
    total = 0
    for reader in readers:
        if reader.opcode in _READS_PART and reader.operands[0] == name:
            size = _elements(reader.shape)
        elif _moves_collective_data(reader) or (reader is root and reader.opcode == "tuple"):
            size = 0
        elif reader.opcode in _PASS_THROUGH:
            size = _sliced_elements(users, reader.name, root, depth + 1, module)
        elif reader.opcode == "pad" and reader.operands[0] == name:
            # Slices of a padded value read its operand in proportion (libtpu's bidirectional
            # collective matmul pads a chunk dim by one and slices either half).
            size = _sliced_elements(users, reader.name, root, depth + 1, module)
            padded, unpadded = _elements(reader.shape), _unpadded_elements(reader)
            if size is not None and padded and unpadded:
                size = size * unpadded // padded
        elif reader.opcode == "fusion" and module is not None:
            size = _nested_sliced_elements(module, reader, name, depth)
        else:
            size = None
        if size is None:
            return None
        total += size
    return total


def _unpadded_elements(pad: _Instr) -> int | None:
    """Elements of a pad's operand: its result's dims less the edge padding."""
    m = re.search(r"\bpadding=([\d_x-]+)", pad.attrs)
    dims = _dims(pad.shape)
    edges = m.group(1).split("x") if m else []
    if not dims or len(edges) != len(dims):
        return None
    total = 1
    for size, edge in zip(dims, edges, strict=True):
        lo, hi, *interior = (int(v) for v in edge.split("_"))
        gap = interior[0] if interior else 0
        total *= max(0, (size - lo - hi + gap) // (gap + 1))
    return total


def _nested_sliced_elements(module: _Module, fusion: _Instr, name: str, depth: int) -> int | None:
    """_sliced_elements of `name` inside the nested fusion `fusion` that reads it."""
    callee = re.search(r"\bcalls=%?([\w.\-]+)", fusion.attrs)
    inner = module.computations.get(callee.group(1)) if callee else None
    if inner is None:
        return None
    params = {}
    for f in inner.instrs:
        m = re.match(r"\s*(\d+)", f.operands[0] if f.opcode == "parameter" and f.operands else "")
        if m:
            params[int(m.group(1))] = f.name
    users = _users(inner)
    total = 0
    for k, operand in enumerate(fusion.operands):
        if operand != name:
            continue
        size = _sliced_elements(users, params[k], inner.root, depth + 1, module) \
            if k in params else None
        if size is None:
            return None
        total += size
    return total


@dataclass(frozen=True)
class Kernel:
    """One kernel launch site of a compiled program (kernel_stats' unit): a fusion or a lone
    instruction of the entry, a loop body or a branch, with its per-step FLOPs and HBM bytes
    (times `multiplier`, the executions per step)."""

    name: str
    opcode: str
    opcodes: frozenset[str]  # the opcodes it computes (a fusion's, through nested calls)
    indexed: bool  # reads or writes only part of an operand (gather, dynamic-(update-)slice)
    multiplier: int
    flops: float  # dot/convolution FLOPs per step
    bytes: float  # bytes read and written per step

    def seconds(self, flop_rate: float, hbm_bandwidth: float) -> float:
        return max(self.flops / flop_rate, self.bytes / hbm_bandwidth)


def compiled_kernels(hlo_text: str) -> list[Kernel]:
    """The kernels of a compiled per-device HLO module, in program order (callers before
    callees): the instructions of the entry and of what control flow calls, less bookkeeping."""
    module = _parse_module(hlo_text)
    multipliers = _multipliers(module)
    # Computations whose instructions are kernels: the entry and what control flow calls.
    control = {module.entry} if module.entry else set()
    order = list(multipliers)  # callers before callees
    for name in order:
        if name not in control:
            continue
        for ins in module.computations[name].instrs:
            if ins.opcode == "while":
                control.update(m.group(1) for m in re.finditer(
                    r"\b(?:body|condition)=%?([\w.\-]+)", ins.attrs))
            elif ins.opcode in ("conditional", "call"):
                control.update(c for c in _callees(ins) if c in module.computations)

    def opcodes(name: str, seen: set) -> set[str]:
        comp = module.computations.get(name)
        if comp is None or name in seen:
            return set()
        seen.add(name)
        found = {i.opcode for i in comp.instrs}
        for i in comp.instrs:
            for callee in _callees(i):
                found |= opcodes(callee, seen)
        return found

    kernels = []
    for name in order:
        if name not in control:
            continue
        mult = multipliers[name][0]
        comp = module.computations[name]
        for ins in comp.instrs:
            if ins.opcode in _NO_KERNEL or _bookkeeping_call(ins):
                continue
            out_bytes = shape_bytes(ins.shape)
            inside = {ins.opcode}
            if ins.opcode == "fusion":
                callee = re.search(r"\bcalls=%?([\w.\-]+)", ins.attrs)
                name_ = callee.group(1) if callee else ""
                fused = module.computations.get(name_)
                read = _fusion_operand_bytes(comp, ins, fused, module)
                out_bytes = _fusion_written_bytes(fused, ins.shape)
                flops = _fused_flops(module, name_, set())
                inside = opcodes(name_, set())
            elif ins.opcode in _READS_PART:
                read, flops = out_bytes, 0.0
            elif ins.opcode == "dynamic-update-slice":
                update = ins.operand_shapes[1] or comp.shapes.get(ins.operands[1], "")
                read = out_bytes = shape_bytes(update) if update else out_bytes
                flops = 0.0
            else:
                read = _operand_bytes(comp, ins) or 0
                flops = _matmul_flops(comp, ins)
            kernels.append(Kernel(
                ins.name, ins.opcode, frozenset(inside),
                ins.opcode in _READS_PART or ins.opcode == "dynamic-update-slice",
                mult, mult * flops, mult * (read + out_bytes)))
    return kernels


def kernel_stats(hlo_text: str, flop_rate: float, hbm_bandwidth: float) -> KernelStats:
    """The per-kernel roofline (see KernelStats) of a compiled per-device HLO module: a closer
    step-time estimate for memory-bound work than total FLOPs or total bytes alone, because a
    kernel is bound by one or the other, not both."""
    kernels = compiled_kernels(hlo_text)
    return KernelStats(sum(k.seconds(flop_rate, hbm_bandwidth) for k in kernels),
                       sum(k.multiplier for k in kernels), sum(k.bytes for k in kernels),
                       sum(k.flops for k in kernels))


def _async_spans(module: _Module, comp: _Computation) -> list[tuple[str, int, int]]:
    """The asynchronous collectives of one scheduled computation: (the collective's name as
    collective_stats gives it, the position of its start, the position of its done). A
    `*-start` / `*-done` pair, or an AsyncCollectiveStart fusion and the AsyncCollectiveDone
    fusion holding a copy of its collective (same kind and channel)."""
    spans: list[tuple[str, int, int]] = []
    open_fused: dict[tuple[str, str], tuple[str, int]] = {}
    starts: dict[str, int] = {}
    for position, ins in enumerate(comp.instrs):
        spec = _OPCODES.get(ins.opcode)
        if spec is not None and spec[1]:
            starts[ins.name] = position
        elif ins.opcode.endswith("-done") and ins.operands and ins.operands[0] in starts:
            spans.append((ins.operands[0], starts.pop(ins.operands[0]), position))
        elif ins.opcode == "fusion":
            callee = re.search(r"\bcalls=%?([\w.\-]+)", ins.attrs)
            fused = module.computations.get(callee.group(1)) if callee else None
            if fused is None:
                continue
            start, done = _is_async_collective_start(fused), _is_async_collective_done(fused)
            if not (start or done):
                continue
            for inner in fused.instrs:
                channel = _CHANNEL.search(inner.attrs)
                if inner.opcode not in _OPCODES or channel is None:
                    continue
                key = (_OPCODES[inner.opcode][0], channel.group(1))
                if start:
                    open_fused[key] = (inner.name, position)
                elif key in open_fused:
                    name, began = open_fused.pop(key)
                    spans.append((name, began, position))
    return spans


def scheduled_overlap(hlo_text: str, kernel_seconds: Mapping[str, float],
                      collective_seconds: Mapping[str, float]) -> dict[str, float]:
    """How much of each asynchronous collective the compiled schedule hides: per execution,
    the kernels the module schedules between its start and its done (each kernel's seconds
    shared evenly among the collectives in flight over it), up to the collective's own seconds.

    `kernel_seconds`: seconds per execution by kernel name (compiled_kernels' names);
    `collective_seconds`: seconds per execution by collective name (CollectiveOp.name). Names
    of collectives that are not asynchronous, or whose done is in another computation, get 0.
    A compiled module's instructions are printed in their schedule's order."""
    module = _parse_module(hlo_text)
    hidden = {name: 0.0 for name in collective_seconds}
    for comp in module.computations.values():
        spans = [s for s in _async_spans(module, comp) if s[0] in collective_seconds]
        if not spans:
            continue
        in_flight = [0] * len(comp.instrs)
        for _, began, ended in spans:
            for position in range(began + 1, ended):
                in_flight[position] += 1
        for name, began, ended in spans:
            under = sum(kernel_seconds.get(comp.instrs[p].name, 0.0) / in_flight[p]
                        for p in range(began + 1, ended))
            hidden[name] = min(collective_seconds[name], under)
    return hidden


# ---------------------------------------------------------------------------------------------
# Memory


_MEMORY_FIELDS = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "generated_code_bytes": "generated_code_size_in_bytes",
}


def memory_stats(compiled: Any) -> dict[str, int | None]:
    """Byte counts from `compiled.memory_analysis()` (a jax `Compiled`, the analysis object
    itself, or a mapping of its fields).

    Keys: argument_bytes, output_bytes, temp_bytes, alias_bytes, generated_code_bytes,
    peak_bytes (= argument + output + temp - alias) and xla_peak_bytes (XLA's own
    `peak_memory_in_bytes` where the backend reports one). Missing fields are None; if the
    analysis is unavailable every value is None.
    """
    analysis: Any = compiled
    if hasattr(compiled, "memory_analysis"):
        try:
            analysis = compiled.memory_analysis()
        except Exception:  # some backends raise NotImplemented / Unimplemented
            analysis = None
    if isinstance(analysis, Iterable) and not isinstance(analysis, Mapping | str | bytes):
        analysis = next(iter(analysis), None)  # older jax returned one entry per device

    def get(attr: str) -> int | None:
        if analysis is None:
            return None
        value = (
            analysis.get(attr) if isinstance(analysis, Mapping) else getattr(analysis, attr, None)
        )
        if value is None:
            return None
        try:
            return int(value)
        except (TypeError, ValueError):
            return None

    out: dict[str, int | None] = {key: get(attr) for key, attr in _MEMORY_FIELDS.items()}
    parts = [out["argument_bytes"], out["output_bytes"], out["temp_bytes"]]
    if all(p is not None for p in parts):
        out["peak_bytes"] = sum(p for p in parts if p is not None) - (out["alias_bytes"] or 0)
    else:
        out["peak_bytes"] = None
    out["xla_peak_bytes"] = get("peak_memory_in_bytes")
    return out


def preallocated_temp_bytes(buffer_assignment_text: str) -> dict[int, int]:
    """Bytes of the preallocated temporaries in XLA's dumped buffer assignment
    (`*after_optimizations-buffer-assignment.txt`, `xla_dump_to` with `xla_dump_hlo_as_text`),
    by memory space (color): 0 is the default memory (HBM on TPU); libtpu's other colors are
    on-chip (1 is VMEM). On TPU the color-0 figure is what the runtime reserves for the
    program's temporaries: on a v5e chip, `memory_stats()["bytes_reserved"]` after a run of
    models.py's gpt, llama or bert train step is that figure plus 16 kB, while
    `memory_analysis().temp_size_in_bytes` is 9 to 80 MB more (no allocation of the dump holds
    those bytes; benchmarks/tpu_reserved.py)."""
    out: dict[int, int] = {}
    for found in re.finditer(r"^allocation \d+: size (\d+),(?: color (\d+),)? preallocated-temp:",
                             buffer_assignment_text, re.M):
        color = int(found.group(2) or 0)
        out[color] = out.get(color, 0) + int(found.group(1))
    return out


def dumped_temp_bytes(dump_dir) -> dict[int, int]:
    """preallocated_temp_bytes of the one compile dumped into `dump_dir` (its
    `*after_optimizations-buffer-assignment.txt`)."""
    from pathlib import Path

    (found,) = Path(dump_dir).glob("*after_optimizations-buffer-assignment.txt")
    return preallocated_temp_bytes(found.read_text())


def live_range_peak(live_range_text: str) -> int | None:
    """XLA's peak of live bytes from the `*-live-range.txt` file it dumps beside the optimized
    HLO (`xla_dump_to` with `xla_dump_hlo_as_text`): the bytes of the buffers live at the peak
    instruction, arguments and results included, before buffer assignment packs the
    temporaries into one allocation (with gaps; the allocation: preallocated_temp_bytes).
    None when the file has no peak section."""
    found = re.search(r"Stack trace breakdown for peak usage: ([\d ]+) bytes", live_range_text)
    if found:
        return int(found.group(1).replace(" ", ""))
    section = live_range_text.partition("(peak):")[2]
    sums = re.findall(r"\(cumulative: (\d+) bytes\)", section)
    return int(sums[-1]) if sums else None


@dataclass(frozen=True)
class LiveBuffer:
    """One buffer of the default memory live at a program point of XLA's dumped schedule:
    `names` are the HLO values that share its bytes (aliases: a while loop's carried value,
    an async op's start and done), `start` and `end` the schedule positions between which one
    of them is live, `kind` its allocation's ("parameter 3, ...", "preallocated-temp", ...)."""

    names: tuple[str, ...]
    bytes: int
    start: int
    end: int
    kind: str


@dataclass(frozen=True)
class LivePeak:
    bytes: int
    time: int  # the position in the live-range dump's InstructionSequence
    buffers: tuple[LiveBuffer, ...]  # largest first


def live_peak(live_range_text: str, buffer_assignment_text: str) -> LivePeak | None:
    """The point of XLA's schedule where the most bytes of the default memory (HBM on TPU)
    are live, and the buffers live there, from the `*after_optimizations-live-range.txt` and
    `*after_optimizations-buffer-assignment.txt` it dumps (`xla_dump_to`,
    `xla_dump_hlo_as_text`).

    A buffer is a slice (allocation, offset, size) of the buffer assignment, live over the
    union of the live ranges of the values placed in it, ends included: an op's operands and
    its result are live together. Counted once per slice, values that alias (a loop's carried
    tuple element and the async collective reading it) are not counted twice, unlike the
    dump's own "(peak)" section, which counts each value. On libtpu's compiles this is
    `memory_analysis().peak_memory_in_bytes` (tested on TPU; within 0.5 MB on the
    Llama-8B-class step)."""
    buffers = _live_buffers(live_range_text, buffer_assignment_text, 0)
    if not buffers:
        return None
    change: dict[int, int] = {}
    for buffer in buffers:
        change[buffer.start] = change.get(buffer.start, 0) + buffer.bytes
        change[buffer.end + 1] = change.get(buffer.end + 1, 0) - buffer.bytes
    live, best, when = 0, -1, 0
    for time in sorted(change):
        live += change[time]
        if live > best:
            best, when = live, time
    held = sorted((b for b in buffers if b.start <= when <= b.end),
                  key=lambda b: (-b.bytes, b.names))
    return LivePeak(best, when, tuple(held))


def _live_buffers(live_range_text: str, buffer_assignment_text: str, color: int
                  ) -> list[LiveBuffer]:
    """The buffers of memory space `color` in a dump (see live_peak): slices of its
    allocations, each live over the merged live ranges of the values placed in it."""
    sizes: dict[str, tuple[int, int, int, str]] = {}  # value -> allocation, offset, size, kind
    allocation: tuple[int, str] | None = None
    for line in buffer_assignment_text.splitlines():
        found = re.match(r"allocation (\d+): size \d+,(.*)$", line)
        if found:
            kind = found.group(2).strip()
            other = re.match(r"color (\d+)", kind)  # 0: the default memory; 1: VMEM on TPU
            allocation = None if int(other.group(1) if other else 0) != color or kind.startswith(
                "thread-local") else (int(found.group(1)), kind)
            continue
        found = re.match(r"\s*value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\)",
                         line)
        if found and allocation:
            sizes[found.group(1).removesuffix("{}")] = (
                allocation[0], int(found.group(3)), int(found.group(2)), allocation[1])
    section = live_range_text.partition("BufferLiveRange:")[2].partition("Live ranges at")[0]
    slices: dict[tuple[int, int, int], list[tuple[int, int, str]]] = {}
    for found in re.finditer(r"^\s+(\S+):(\d+)-(\d+)$", section, re.M):
        name = found.group(1).removesuffix("{}")
        if name in sizes:
            index, offset, size, _ = sizes[name]
            slices.setdefault((index, offset, size), []).append(
                (int(found.group(2)), int(found.group(3)), name))
    kinds = {(index, offset, size): kind for index, offset, size, kind in sizes.values()}
    buffers: list[LiveBuffer] = []
    for key, ranges in slices.items():  # the values of one slice, merged where they overlap
        ranges.sort()
        start, end, names = ranges[0][0], ranges[0][1], [ranges[0][2]]
        for begin, finish, name in ranges[1:]:
            if begin <= end:
                end, names = max(end, finish), names + [name]
            else:
                buffers.append(LiveBuffer(tuple(names), key[2], start, end, kinds[key]))
                start, end, names = begin, finish, [name]
        buffers.append(LiveBuffer(tuple(names), key[2], start, end, kinds[key]))
    return buffers


def live_at(live_range_text: str, buffer_assignment_text: str, time: int,
            color: int = 1) -> tuple[LiveBuffer, ...]:
    """The buffers of memory space `color` (default 1: libtpu's on-chip VMEM, which its HBM
    figures leave out) live at position `time` of the schedule, largest first: what libtpu
    keeps on chip at its HBM peak (live_peak(...).time)."""
    return tuple(sorted((b for b in _live_buffers(live_range_text, buffer_assignment_text, color)
                         if b.start <= time <= b.end), key=lambda b: (-b.bytes, b.names)))


def dumped_live_peak(dump_dir) -> LivePeak | None:
    """live_peak of the one compile dumped into `dump_dir`."""
    from pathlib import Path

    (ranges,) = Path(dump_dir).glob("*after_optimizations-live-range.txt")
    (assignment,) = Path(dump_dir).glob("*after_optimizations-buffer-assignment.txt")
    return live_peak(ranges.read_text(), assignment.read_text())
