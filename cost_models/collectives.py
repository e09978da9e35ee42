"""Analytic alpha-beta cost of collectives over mesh axes, on the ring algorithm.

A collective runs over a group of mesh axes (indices into the mesh). Its group size n is the
product of their sizes; it moves data at the lowest bandwidth among the links those axes run over
(`hardware.axis_links`) and pays the highest of their latencies per step. With S the bytes named
below, bw the bandwidth and lat the latency:

    all-reduce      2(n-1)/n * S / bw + 2(n-1) * lat   S = the buffer each device holds
    all-gather       (n-1)/n * S / bw +  (n-1) * lat   S = the result on each device (after)
    reduce-scatter   (n-1)/n * S / bw +  (n-1) * lat   S = the input on each device (before)
    all-to-all       (n-1)/n * S / bw +  (n-1) * lat   S = the buffer each device holds

plus the device model's `collective_overhead` per call (launch and synchronisation), which makes
one collective cheaper than two moving the same bytes (an all-reduce against a reduce-scatter
and an all-gather).

Every collective costs 0 when n == 1 or S == 0. `bytes_sent` gives the bandwidth term's bytes
(what each device sends), to compare with the collectives XLA actually compiled.

A sharding here is a tuple with one entry per tensor dimension; each entry is the tuple of mesh
axis indices (major to minor) that split that dimension, () for a replicated dimension. So on a
mesh (data=2, model=4), ((0,), ()) splits dim 0 over data, ((), (0, 1)) splits dim 1 over all 8
devices. `CommModel.reshard` prices changing one sharding into another; see its docstring.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from hloplan.cost_models.hardware import DeviceModel, Interconnect, axis_links
from hloplan.mesh import MeshSpec

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "ALL_TO_ALL",
    "COLLECTIVE_KINDS",
    "REDUCE_SCATTER",
    "AxisGroup",
    "CommModel",
    "ReshardCost",
    "Sharding",
    "local_bytes",
]

ALL_REDUCE = "all-reduce"
ALL_GATHER = "all-gather"
REDUCE_SCATTER = "reduce-scatter"
ALL_TO_ALL = "all-to-all"
# Not a priced kind of `collective` (no ring, no combiner): reshards list it, priced as one
# send of each device's shard.
COLLECTIVE_PERMUTE = "collective-permute"
COLLECTIVE_KINDS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL)
_KIND_SET = frozenset(COLLECTIVE_KINDS)

Sharding = tuple[tuple[int, ...], ...]
Axes = tuple[int, ...]


def _kind(kind: str) -> str:
    if kind in _KIND_SET:  # the hot path: already canonical
        return kind
    name = kind.strip().lower().replace("_", "-")
    if name not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective {kind!r} (known: {', '.join(COLLECTIVE_KINDS)})")
    return name


@dataclass(frozen=True)
class AxisGroup:
    """The devices a collective over some mesh axes runs among, and the link it is limited by."""

    axes: Axes
    size: int  # n: devices per group
    bandwidth: float  # bytes/s: the slowest link among the axes
    latency: float  # seconds per step: the highest latency among the axes


@dataclass(frozen=True)
class ReshardCost:
    """Seconds to change a tensor's sharding, and the collectives that do it.

    Each collective is (kind, mesh axes, bytes each device sends).
    """

    seconds: float
    collectives: tuple[tuple[str, Axes, float], ...] = ()
    # Layouts the tensor passes through, in order, when a multi-axis all-gather is done one
    # axis at a time (CommModel's staged_gathers): what the plan must pin for XLA to do it so.
    via: tuple[Sharding, ...] = ()

    @property
    def bytes_sent(self) -> float:
        """Total bytes each device sends over all the collectives."""
        return sum(sent for _, _, sent in self.collectives)


def local_bytes(
    shape: Sequence[int], itemsize: int, sharding: Sequence[Sequence[int]], mesh: MeshSpec
) -> int:
    """Bytes of one device's shard: each dim divided by its axes' sizes, rounded up (as XLA pads)."""
    total = itemsize
    for dim, axes in zip(shape, sharding, strict=True):
        parts = math.prod(mesh.axis_sizes[a] for a in axes)
        total *= -(-dim // parts)
    return total


class CommModel:
    """Alpha-beta ring costs of collectives over the axes of `mesh` on `model`'s interconnect.

    `hosts`, if given, is how many hosts the mesh's devices are spread over (see
    `hardware.axis_links`). `links[i]` is the interconnect level mesh axis i runs over.

    `combine`, if given, models XLA's collective combiners: collective kind -> bytes per merged
    collective (a device model's `combiner`). Independent collectives of a kind (the gradient
    all-reduces of many parameters) are merged into buffers of about that size, so one of S
    bytes pays only min(1, S / threshold) of the per-call latency (none when the platform merges
    them all: threshold inf); a threshold of 0, or no `combine`, makes every collective pay its
    full latency; so does a reduce-scatter on a TPU slice where libtpu merges none
    (DeviceModel.reduce_scatter_apart). The first buffer's launch, which a plan pays once if it
    issues the kind at all, is `launch_latency` (the planner charges it through the problem's launches, where it
    costs at least BuildShardingProblem.min_launch_s).
    """

    def __init__(self, model: DeviceModel, mesh: MeshSpec, hosts: int | None = None,
                 combine: Mapping[str, float] | None = None, staged_gathers: bool = False) -> None:
        self.model = model
        self.mesh = mesh
        self.hosts = hosts
        # XLA's TPU compiler gathers every axis a reshard removes in one all-gather, whatever
        # dims they are on ([x, y] -> [-, -] is one all-gather over (x, y)): no stages either.
        self.one_gather = model.gathers == "one"
        self.staged_gathers = staged_gathers and not self.one_gather
        self.combine = {_kind(k): float(v) for k, v in (combine or {}).items() if v > 0}
        self.links: tuple[Interconnect, ...] = axis_links(model, mesh, hosts)
        # Memos: the planner prices ~10^4 reshards between the same few axis groups and
        # layouts, and validating them each time dominated the cost.
        self._groups: dict = {}
        self._checked: dict = {}
        self._plans: dict = {}  # (src, dst) -> _reshard_plan's analysis
        self._apart: dict[int, bool] = {}

    def __repr__(self) -> str:
        links = ", ".join(
            f"{name}:{link.name}"
            for name, link in zip(self.mesh.axis_names, self.links, strict=True)
        )
        hosts = f", hosts={self.hosts}" if self.hosts is not None else ""
        return f"CommModel({self.model.name}, {self.mesh}{hosts}; {links})"

    # --- axis groups ------------------------------------------------------------------------

    def _axes(self, axes: int | str | Iterable[int | str]) -> Axes:
        if isinstance(axes, int | str):
            axes = (axes,)
        result: list[int] = []
        for axis in axes:
            if isinstance(axis, str):
                index = self.mesh.axis_index(axis)
            elif isinstance(axis, bool) or not isinstance(axis, int):
                raise ValueError(f"mesh axis {axis!r} is neither an index nor a name")
            elif not 0 <= axis < self.mesh.ndim:
                raise ValueError(f"mesh axis {axis} out of range for mesh {self.mesh}")
            else:
                index = axis
            if index in result:
                raise ValueError(f"mesh axis {axis!r} appears twice in {tuple(axes)!r}")
            result.append(index)
        return tuple(result)

    def group(self, axes: int | str | Iterable[int | str]) -> AxisGroup:
        """Group size, bottleneck bandwidth and latency of a collective over `axes`."""
        try:
            return self._groups[axes]
        except (KeyError, TypeError):  # TypeError: an unhashable list of axes
            pass
        found = self._group(axes)
        try:
            self._groups[axes] = found
        except TypeError:
            pass
        return found

    def _group(self, axes: int | str | Iterable[int | str]) -> AxisGroup:
        index = self._axes(axes)
        if not index:
            return AxisGroup((), 1, math.inf, 0.0)
        links = [self.links[a] for a in index]
        return AxisGroup(
            axes=index,
            size=math.prod(self.mesh.axis_sizes[a] for a in index),
            bandwidth=min(link.bandwidth for link in links),
            latency=max(link.latency for link in links),
        )

    def axes_label(self, axes: int | str | Iterable[int | str]) -> str:
        """Mesh axis names joined by ',' (e.g. 'data,model'); '' for no axes."""
        return ",".join(self.mesh.axis_names[a] for a in self._axes(axes))

    # --- collectives ------------------------------------------------------------------------

    def bytes_sent(self, kind: str, nbytes: float, axes: int | str | Iterable[int | str]) -> float:
        """Bytes each device sends in the ring algorithm: 2(n-1)/n*S for all-reduce, else (n-1)/n*S."""
        kind = _kind(kind)
        n = self.group(axes).size
        if n == 1 or nbytes <= 0:
            return 0.0
        factor = 2.0 if kind == ALL_REDUCE else 1.0
        return factor * (n - 1) / n * nbytes

    def collective(self, kind: str, nbytes: float, axes: int | str | Iterable[int | str]) -> float:
        """Seconds for a collective of `kind` ('all-reduce', 'all-gather', ...) over `axes`."""
        kind = _kind(kind)
        group = self.group(axes)
        n = group.size
        if n == 1 or nbytes <= 0:
            return 0.0
        latency = self._latency(kind, group)
        threshold = self._threshold(kind, group)
        if threshold:
            latency *= min(1.0, nbytes / threshold)  # 0 when all are merged (threshold inf)
        return self.bytes_sent(kind, nbytes, group.axes) / group.bandwidth + latency

    def _threshold(self, kind: str, group: AxisGroup) -> float | None:
        """Bytes per merged collective of `kind` over `group` (None: not merged). libtpu merges
        no reduce-scatter on some slices (DeviceModel.reduce_scatter_apart)."""
        threshold = self.combine.get(kind)
        if threshold and kind == REDUCE_SCATTER:
            apart = self._apart.get(group.size)
            if apart is None:
                apart = self._apart[group.size] = self.model.reduce_scatter_apart(
                    self.mesh.size, group.size)
            if apart:
                return None
        return threshold

    def _latency(self, kind: str, group) -> float:
        steps = 2 * (group.size - 1) if kind == ALL_REDUCE else group.size - 1
        return steps * group.latency + self.model.collective_overhead

    def launch_latency(self, kind: str, axes: int | str | Iterable[int | str]) -> float:
        """The latency of one merged buffer of `kind` over `axes`: what a plan pays once for
        using the kind at all, on top of each collective's share (`collective`); 0 for a kind
        the combiners do not merge (each of those pays its latency in full already)."""
        kind = _kind(kind)
        group = self.group(axes)
        if group.size == 1 or not self._threshold(kind, group):
            return 0.0
        return self._latency(kind, group)

    def all_reduce(self, nbytes: float, axes: int | str | Iterable[int | str]) -> float:
        """All-reduce of a buffer of `nbytes` on each device."""
        return self.collective(ALL_REDUCE, nbytes, axes)

    def all_gather(self, nbytes_full: float, axes: int | str | Iterable[int | str]) -> float:
        """All-gather whose result is `nbytes_full` on each device."""
        return self.collective(ALL_GATHER, nbytes_full, axes)

    def reduce_scatter(self, nbytes_full: float, axes: int | str | Iterable[int | str]) -> float:
        """Reduce-scatter of an input of `nbytes_full` on each device (before scattering)."""
        return self.collective(REDUCE_SCATTER, nbytes_full, axes)

    def all_to_all(self, nbytes_local: float, axes: int | str | Iterable[int | str]) -> float:
        """All-to-all of a buffer of `nbytes_local` on each device."""
        return self.collective(ALL_TO_ALL, nbytes_local, axes)

    def collective_permute(self, nbytes: float, axes: int | str | Iterable[int | str]) -> float:
        """A collective-permute sending `nbytes` from each device to another of the group over
        `axes` (one hop)."""
        group = self.group(axes)
        if group.size == 1 or nbytes <= 0:
            return 0.0
        return nbytes / group.bandwidth + group.latency + self.model.collective_overhead

    def _gather_kind(self, shape: Sequence[int], src: Sequence[Sequence[int]]) -> str:
        """The collective that all-gathers a tensor of `shape` laid out `src`: an all-reduce
        (of the whole, each shard written into zeros) where the device model's
        `vector_gather_lanes` says so: a vector (one dim longer than 1) whose shard is not a
        multiple of that many elements; else an all-gather."""
        lanes = self.model.vector_gather_lanes
        long = [d for d, size in enumerate(shape) if size > 1]
        if lanes and len(long) == 1:
            d = long[0]
            parts = math.prod(self.mesh.axis_sizes[a] for a in src[d])
            if parts > 1 and -(-shape[d] // parts) % lanes:
                return ALL_REDUCE
        return ALL_GATHER

    def tiled_scatter(self, shard: Sequence[int], itemsize: int, dim: int, n: int,
                      row_major: bool = False) -> tuple[float, float]:
        """The bytes a reduce-scatter of partial sums moves, scattered n ways onto dim `dim`
        into a `shard` on each device: (the partial sums its all-reduce takes, the bytes of
        the collective-permute after it). n x the shard and 0 unless the device model's
        `scatter_tiles` (rows, lanes) says the compiler scatters tiles (libtpu 0.0.42: an
        all-reduce of the tiled partial sums and a slice of each device's tiles, fused into
        its all-reduce-scatter kernel), where it depends on the partial sums' layout
        (tpu_buffers.minor_dims: a matmul's last two dims in the order that pads least,
        `row_major` ones, a scatter's or a gather's, in the program's order):
          - `dim` minor: its own bytes (an all-reduce and a slice: [1026, 192] over 2, 1,026
            rows minor);
          - `dim` second-minor: the kernel splits each shard into pieces of whole row
            tiles, each piece P rows: the shard is padded to a multiple of P (S = 513 rows,
            P = 8: 520), the all-reduce takes n x the padded shard and device k lacks the
            first k(padded - S) rows of its shard, which devices k - 1, k - 2, ... hold:
            collective-permutes of (n - 1)(padded - S) rows in all (one of P rows per device
            it reaches back, the rest in the last: 24 + 4 rows for S = 20 over 8); only while
            the padding is under half the shard (padded < 1.5 S; elsewhere libtpu all-reduces
            and slices: 6 rows or 40 over 4, 20 rows over 8 on 128 lanes). The pieces: as few
            as hold at most the device model's `scatter-chunk` tiles over n devices each
            (ScatterChunk.tiles: 184 tiles over 16 devices of v5e, 444 over 4), doubled where
            a row is an odd number of lane tiles (a partial lane tile counting as one), so
            [2000, 64] over 16 (250 row tiles) takes 4 pieces and pads to 2,016 rows, [2048,
            256] over 16 (256 x 2 tiles) 3 pieces, 2,064 rows; without `scatter-chunk`, one
            piece (two for an odd number of whole lane tiles), and so for rows of more lane
            tiles than its `max-lane-tiles` (3), where the pieces follow no rule found (200 rows
            of 63 lane tiles over 8 pad to 224; 24 rows of 255 are not padded). Over more
            devices than its `max-devices` the shards are not padded (256 of v5e:16x16). Not
            modelled: a minor
            dim of partial lane tiles scattered is padded or not by no rule found (24 of 192
            columns over 8 padded to 32 with 50,257 or 16,383 rows, hf_gpt2's output head;
            not with 30,522 or 40,000, which libtpu all-reduces with others);
          - `dim` major to both: the buffer's tiles (the second-minor dim padded to whole
            rows, the minor to whole lanes, each where longer than one tile: [16, 20, 100]
            as [16, 24, 100]; a gather's [16, 128, 192] as [16, 128, 256], where a matmul's
            is kept 128 minor and moves as it is).
        Found by compiling reduce-scattered matmuls for v5e:2x4 and 4x8 (tests/unit/
        test_tpu_scatter_tiles.py)."""
        full = float(n * math.prod(shard) * itemsize)
        tiles = self.model.scatter_tiles
        if not tiles or n <= 1 or len(shard) < 2 or not full:
            return full, 0.0
        from hloplan.tpu_buffers import minor_dims

        rows, lanes = tiles
        # Dims of size 1 take no tile: libtpu lays them out major (hf_llama's [64, 511, 1]
        # gathered label logits are scattered as [64, 511]).
        kept = [d for d, size in enumerate(shard) if size > 1 or d == dim]
        if len(kept) < 2:
            return full, 0.0
        shard, dim = [shard[d] for d in kept], kept.index(dim)
        partial = tuple(size * n if d == dim else size for d, size in enumerate(shard))
        minor, second = minor_dims(partial, row_major, last_two=True)
        if dim == minor:
            return full, 0.0
        if dim == second:
            chunk = self.model.scatter_chunk
            if chunk is not None and n > chunk.max_devices:
                return full, 0.0
            size = shard[dim]
            lane_tiles = -(-partial[minor] // lanes)
            if chunk is not None and lane_tiles <= chunk.max_lane_tiles:
                # A partial lane tile takes a whole one (64 columns pad as 128 do).
                row_tiles = -(-size // rows)
                pieces = math.ceil(row_tiles * lane_tiles / chunk.tiles(n))
                pieces *= 2 if lane_tiles % 2 else 1  # an odd number: the rows split in pairs
            else:
                # Wider rows (or no `scatter-chunk`): whole pairs of row tiles where the row
                # is an odd number of whole lane tiles, else whole row tiles.
                pieces = 2 if partial[minor] % lanes == 0 and lane_tiles % 2 else 1
            step = rows * pieces
            padded = -(-size // step) * step
            extra = padded - size
            if not extra or 2 * padded >= 3 * size:
                return full, 0.0
            row = full / n / size
            return n * padded * row, (n - 1) * extra * row
        tiled = 1
        for d, size in enumerate(partial):
            if d == minor and size > lanes:
                size = -(-size // lanes) * lanes
            elif d == second and size > rows:
                size = -(-size // rows) * rows
            tiled *= size
        return float(tiled * itemsize), 0.0

    # --- compute ----------------------------------------------------------------------------

    def compute_time(self, flops: float, bytes_accessed: float, dtype: object) -> float:
        """Roofline time: max(flops / peak FLOP/s for `dtype`, bytes / HBM bandwidth)."""
        return max(flops / self.model.flops_for(dtype), bytes_accessed / self.model.hbm_bandwidth)

    # --- resharding -------------------------------------------------------------------------

    def _check_sharding(self, sharding: Sequence[Sequence[int]], rank: int, what: str) -> Sharding:
        try:
            return self._checked[sharding, rank]
        except (KeyError, TypeError):
            pass
        result = self._validate_sharding(sharding, rank, what)
        try:
            self._checked[sharding, rank] = result
        except TypeError:
            pass
        return result

    def _validate_sharding(self, sharding: Sequence[Sequence[int]], rank: int,
                           what: str) -> Sharding:
        if len(sharding) != rank:
            raise ValueError(
                f"{what} sharding {sharding!r} has {len(sharding)} entries for a rank-{rank} tensor"
            )
        seen: set[int] = set()
        result = []
        for entry in sharding:
            axes = self._axes(entry)
            for axis in axes:
                if axis in seen:
                    raise ValueError(f"{what} sharding {sharding!r} uses mesh axis {axis} twice")
                seen.add(axis)
            result.append(axes)
        return tuple(result)

    def reshard(
        self,
        shape: Sequence[int],
        itemsize: int,
        src: Sequence[Sequence[int]],
        dst: Sequence[Sequence[int]],
        staged: bool | None = None,
    ) -> ReshardCost:
        """Cost of changing a tensor of `shape` from sharding `src` to sharding `dst`.
        `staged`: whether a multi-axis all-gather may go one axis at a time (see via); None
        takes the model's staged_gathers. A reshard nobody pins (jax.device_put between
        programs) goes as XLA does it: staged=False.

        On each dim d, the longest common prefix of src[d] and dst[d] stays put. Every src axis
        after that prefix leaves dim d, minor-most first:
          1. all-gathers: axes that leave d and are not on another dim in dst (including axes
             that only change position within d), one all-gather per dim over those axes, the
             last dim first, as XLA's partitioner orders them whatever the links (so [x, y] ->
             [-, -] gathers y on the small shard, then x on the y-gathered block: the cheaper
             way when x is the slow axis is [y, x]); its size is the per-device tensor after
             the gather;
          2. all-to-alls: axes that move to another dim d', one all-to-all per (d, d') pair over
             those axes, sized by the per-device tensor at that moment; but XLA's partitioner
             moves axes into a dim by all-to-all from one source dim only: axes that arrive
             at one dim from two or more dims ([x, y, -] -> [-, -, (x, y)]), or leave one dim
             for two or more ([-, -, (x, y)] -> [x, y, -]), are all-gathered where they are in
             step 1 instead; an axis that stays on its dim while others leave it or join it by
             all-to-all is not gathered when the dim keeps its axes in order (XLA renumbers the
             devices: [-, -, (x, y)] -> [x, -, y] is one all-to-all over x);
          3. slices: dst axes not yet in place are free (each device keeps its part).
        On a device model with [collectives] gathers = "one" (XLA's TPU compiler), the
        all-gathers of step 1 are one all-gather over all their axes (mesh order), sized by the
        per-device tensor after it.
        The per-device size is tracked through the steps (dims rounded up, as XLA pads). This is
        exact for the common cases, S->R (all-gather), S(d)->S(d') (all-to-all) and R->S (free);
        more tangled changes are priced as that sequence of steps.
        """
        rank = len(shape)
        src_s = self._check_sharding(src, rank, "source")
        dst_s = self._check_sharding(dst, rank, "destination")
        exchanged = self._exchange(shape, itemsize, src_s, dst_s)
        if exchanged is not None:
            return exchanged
        (dst_dim, leaving, swapped, gathered_into, gathered_from, reordered, renumbered,
         renumbered_dims) = self._reshard_plan(src_s, dst_s)
        current = [list(axes) for axes in src_s]

        def size() -> int:
            return local_bytes(shape, itemsize, current, self.mesh)

        steps: list[tuple[str, Axes, float]] = []
        seconds = 0.0

        def record(kind: str, nbytes: float, axes: Axes, label: Axes | None = None) -> None:
            nonlocal seconds
            sent = self.bytes_sent(kind, nbytes, axes)
            if sent > 0:
                seconds += self.collective(kind, nbytes, axes)
                steps.append((kind, axes if label is None else label, sent))

        def record_gather(nbytes: float, axes: Axes) -> None:
            if gather == ALL_GATHER:
                record(ALL_GATHER, nbytes, axes)
                return
            # A vector's gather run as an all-reduce (_gather_kind) moves the all-reduce's bytes
            # and is priced one launch of the all-gather's n - 1 steps: libtpu merges some of
            # them into one all-reduce of 2(n - 1) steps (keras_gemma's nine norm scales on
            # v5e:16x16) and leaves others apart at 2(n - 1) each (a convnet's norm parameters
            # on v5e:2x4), by no rule found. Priced as merged (nearly free) the planner split
            # every vector, at 2(n - 1) steps each none; both plans compiled slower (docs/tpu.md,
            # `vector-gather-lanes`).
            nonlocal seconds
            sent = self.bytes_sent(ALL_REDUCE, nbytes, axes)
            if sent > 0:
                group = self.group(axes)
                seconds += sent / group.bandwidth + self._latency(ALL_GATHER, group)
                steps.append((ALL_REDUCE, axes, sent))

        for axes in [*reordered, *(axes for axes, _, _, _ in swapped)]:
            group = self.group(axes)
            seconds += size() / group.bandwidth + group.latency
            steps.append((COLLECTIVE_PERMUTE, tuple(axes), float(size())))
        for _, s, t, moved in swapped:  # in place by the permute, gathered in step 1
            current[s] = [a for a in current[s] if a not in moved]
            current[t].extend(moved)
        # 1. all-gathers, the last dim first (tests/unit/test_hlo_stats.py checks XLA's order),
        # or all in one (one_gather)
        via: list[Sharding] = []
        together: list[int] = []
        gather = self._gather_kind(shape, current)
        for d in reversed(range(rank)):
            gathered = tuple(a for a in leaving[d]
                             if dst_dim.get(a, d) == d or dst_dim[a] in gathered_into
                             or d in gathered_from)
            if not gathered:
                continue
            if self.one_gather:
                current[d] = [a for a in current[d] if a not in gathered]
                together.extend(gathered)
                continue
            stages = self._gather_stages(shape, itemsize, current, d, gathered,
                                         self.staged_gathers if staged is None else staged)
            if stages is None:
                current[d] = [a for a in current[d] if a not in gathered]
                record_gather(size(), gathered)
                continue
            for axis in stages:
                current[d].remove(axis)
                record_gather(size(), (axis,))
                via.append(tuple(tuple(axes) for axes in current))
        if together:
            record_gather(size(), tuple(sorted(together)))
        # 2. all-to-alls
        for d in range(rank):
            targets = sorted({dst_dim[a] for a in leaving[d]
                              if dst_dim.get(a, d) != d and dst_dim[a] not in gathered_into
                              and d not in gathered_from})
            for target in targets:
                moved = tuple(a for a in leaving[d] if dst_dim.get(a) == target)
                record(ALL_TO_ALL, size(), moved, self._minor_factor(current[d], moved)
                       if d in renumbered_dims else None)
                current[d] = [a for a in current[d] if a not in moved]
                current[target].extend(moved)
        # The collective-permutes that put renumbered shards in place (a permute sends the
        # whole local tensor once, one hop).
        for axes in renumbered:
            group = self.group(axes)
            if group.size > 1:
                seconds += size() / group.bandwidth + group.latency
                steps.append((COLLECTIVE_PERMUTE, tuple(axes), float(size())))
        # 3. slices: free where each device's block holds its new shard: the axes kept on a
        # dim come first in its new order, the sliced ones after them. 4. Elsewhere (an axis
        # sliced in ahead of a kept one, [-, y] -> [-, (x, y)]; kept axes reordered,
        # [-, (y, x)] -> [-, (x, y)]) XLA's partitioner (CPU and libtpu v5e:2x4) slices the
        # layout whose order that allows and sends each device's shard to its new device: one
        # collective-permute of the new shard over the dim's axes.
        for d in range(rank):
            kept = [a for a in current[d] if a in src_s[d]]
            sliced = [a for a in dst_s[d] if a not in current[d]]
            if [a for a in dst_s[d] if a in kept or a in sliced] != kept + sliced:
                nbytes = local_bytes(shape, itemsize, dst_s, self.mesh)
                group = self.group(dst_s[d])
                seconds += nbytes / group.bandwidth + group.latency + self.model.collective_overhead
                steps.append((COLLECTIVE_PERMUTE, tuple(sorted(group.axes)), float(nbytes)))
        if via and via[-1] == dst_s:
            via.pop()
        return ReshardCost(seconds, tuple(steps), tuple(via))

    def _reshard_plan(self, src_s: Sharding, dst_s: Sharding) -> tuple:
        """Which axes `reshard` gathers, moves, permutes and renumbers between two checked
        shardings: that depends on the shardings alone, not the shape, so it is worked out once
        per pair (a 2-layer GPT-3 on 16x8x8 prices 80k reshards between far fewer pairs)."""
        key = (src_s, dst_s)
        found = self._plans.get(key)
        if found is not None:
            return found
        rank = len(src_s)
        dst_dim = {axis: d for d, axes in enumerate(dst_s) for axis in axes}
        src_dim = {axis: d for d, axes in enumerate(src_s) for axis in axes}

        leaving: list[list[int]] = []
        for d in range(rank):
            keep = 0
            while (
                keep < len(src_s[d]) and keep < len(dst_s[d]) and src_s[d][keep] == dst_s[d][keep]
            ):
                keep += 1
            leaving.append(list(src_s[d][keep:]))

        # Axes that leave their dim whole for a dim whose own axes are all gathered, and come
        # before them in mesh order ([-, y, x] -> [-, x, -], [y, x] -> [x, -]): XLA's
        # partitioner sends each device's shard to a device of the destination's order (one
        # collective-permute of the local tensor), then gathers the other axes there, with no
        # all-to-all (libtpu v5e:2x4; the CPU compiler the same bytes, gathered in two steps).
        # The other way round ([-, x, y] -> [-, y, -]) it gathers, then moves y by all-to-all.
        swapped: list[tuple[list[int], int, int, list[int]]] = []
        for t in range(rank):
            arriving = list(dst_s[t])
            if (not src_s[t] or not arriving or any(a in dst_dim for a in src_s[t])
                    or any(a not in src_dim for a in arriving)):
                continue
            s = src_dim[arriving[0]]
            # One axis arriving (CPU compiler, two and three mesh axes); two arriving
            # ([-, (x, y), z] -> [-, -, (x, y)], gpt's embedding gradient on 16x8x8) move by an
            # all-to-all, as the general rule below prices.
            if (s != t and list(src_s[s]) == arriving and leaving[s] == arriving
                    and max(arriving) < min(src_s[t]) and len(arriving) == 1):
                swapped.append((sorted([*arriving, *src_s[t]]), s, t, arriving))
                leaving[s] = []

        sources: dict[int, set[int]] = {}  # target dim -> the dims axes move to it from
        for d in range(rank):
            for axis in leaving[d]:
                if dst_dim.get(axis, d) != d:
                    sources.setdefault(dst_dim[axis], set()).add(d)
        gathered_into = {t for t, dims in sources.items() if len(dims) > 1}
        # Nor does it move axes out of one dim into two or more, or move some out of a dim
        # while it gathers others there: it all-gathers them all there, then slices
        # ([-, -, (x, y)] -> [x, y, -], [x, -, -] or [y, -, -]: one all-gather over (x, y), on
        # libtpu v5e:2x4 and 16x16 and the CPU compiler).
        gathered_from = {d for d in range(rank)
                         if len({dst_dim[a] for a in leaving[d]
                                 if dst_dim.get(a, d) != d}) > 1
                         or (any(dst_dim.get(a, d) != d for a in leaving[d])
                             and any(a not in dst_dim for a in leaving[d]))}
        # Axes that stay on their dim while others leave it or arrive at it by all-to-all need
        # no gather when they keep their order: XLA's partitioner moves the others by one
        # all-to-all among the devices that hold each new shard's parts, then puts the shards
        # on the devices the destination names by a collective-permute of the whole local
        # tensor (libtpu and the CPU compiler on 2x4: [-, -, (x, y)] -> [x, -, y],
        # [(x, y), -] -> [y, x], [x, -, y] -> [-, -, (x, y)]).
        renumbered: list[list[int]] = []
        renumbered_dims: set[int] = set()
        # Axes that stay on their dim, minor to axes gathered there, are the whole of the
        # destination's dim after the kept ones: XLA's partitioner sends each device's shard to
        # the device that holds it with the gathered axes minor-most (one collective-permute
        # of the local tensor), then gathers them ([-, -, (x, y)] -> [-, -, y]: a permute and
        # an all-gather over x, libtpu v5e:2x4 and the CPU compiler).
        reordered: list[list[int]] = []
        for d in range(rank):
            staying = [a for a in leaving[d] if dst_dim.get(a) == d]
            gathered = [a for a in leaving[d] if a not in dst_dim]
            kept = len(src_s[d]) - len(leaving[d])
            if (staying and gathered and len(staying) + len(gathered) == len(leaving[d])
                    and list(dst_s[d][kept:]) == staying
                    and leaving[d][-len(staying):] == staying):
                reordered.append(sorted(leaving[d]))
                leaving[d] = gathered
        for d in range(rank):
            staying = [a for a in leaving[d] if dst_dim.get(a) == d]
            moving = [a for a in leaving[d] if a not in staying]
            arriving = [a for a in dst_s[d] if a not in src_s[d]]
            # (an axis that arrives by a slice, from no dim, needs no all-to-all: step 4)
            if (staying and (moving or any(a in src_dim for a in arriving))
                    and d not in gathered_into
                    and d not in gathered_from
                    and staying == [a for a in dst_s[d] if a in staying]
                    and all(a in dst_dim and dst_dim[a] not in gathered_into for a in moving)):
                leaving[d] = moving
                renumbered.append(sorted({*staying, *moving,
                                          *(a for a in arriving if a in src_dim)}))
                renumbered_dims.add(d)
            # Axes that only change order on their dim are not gathered: XLA's partitioner
            # sends each device's shard to its new place (one collective-permute, step 4).
            elif (staying and not moving and all(a not in src_dim for a in arriving)
                    and d not in gathered_into and d not in gathered_from):
                leaving[d] = []
        found = (dst_dim, tuple(tuple(axes) for axes in leaving), tuple(swapped),
                 frozenset(gathered_into), frozenset(gathered_from), tuple(reordered),
                 tuple(renumbered), frozenset(renumbered_dims))
        self._plans[key] = found
        return found

    def _exchange(self, shape: Sequence[int], itemsize: int, src: Sharding,
                  dst: Sharding) -> ReshardCost | None:
        """Two dims that exchange their one axis each ([x, y] -> [y, x]), the others unchanged:
        XLA's partitioner (libtpu on v5e:2x4, 4x4 and 4x8, and the CPU compiler) exchanges
        parts of the local shard among groups of size(larger axis) / size(smaller axis)
        devices of the larger axis (an all-to-all over part of it, none where the two are
        equal), which leaves each device a shard of the destination's shape, then puts the
        shards on the devices the destination names by a collective-permute of the whole
        local tensor over both axes. None where the change is not such an exchange."""
        changed = [d for d in range(len(shape)) if src[d] != dst[d]]
        if len(changed) != 2:
            return None
        d0, d1 = changed
        if not (len(src[d0]) == len(src[d1]) == 1 and src[d0] == dst[d1]
                and src[d1] == dst[d0]):
            return None
        (a,), (b,) = src[d0], src[d1]
        small, large = sorted((a, b), key=lambda axis: (self.mesh.axis_sizes[axis], axis))
        parts = self.mesh.axis_sizes[large] // self.mesh.axis_sizes[small]
        seconds = 0.0
        steps: list[tuple[str, Axes, float]] = []
        if parts > 1:
            local = local_bytes(shape, itemsize, src, self.mesh)
            group = self.group((large,))
            sent = (parts - 1) / parts * local
            seconds += (sent / group.bandwidth + (parts - 1) * group.latency
                        + self.model.collective_overhead)
            steps.append((ALL_TO_ALL, (large,), sent))
        nbytes = float(local_bytes(shape, itemsize, dst, self.mesh))
        group = self.group((a, b))
        seconds += nbytes / group.bandwidth + group.latency
        steps.append((COLLECTIVE_PERMUTE, tuple(sorted((a, b))), nbytes))
        return ReshardCost(seconds, tuple(steps))

    def _minor_factor(self, axes: Sequence[int], moved: Axes) -> Axes:
        """The mesh axes an all-to-all that renumbers devices, moving `moved` out of a dim split
        over `axes` while others stay, travels on: XLA exchanges among the devices of the dim's
        minor-most factor of the moved size (a part of y when x leaves (x, y), libtpu and CPU
        on 2x4). Its bytes and group size are the moved axes'."""
        need = math.prod(self.mesh.axis_sizes[a] for a in moved)
        spanned: list[int] = []
        for axis in reversed(axes):
            if math.prod(self.mesh.axis_sizes[a] for a in spanned) >= need:
                break
            spanned.append(axis)
        return tuple(sorted(spanned))  # mesh order, as hlo_stats lists a group's axes

    def _gather_stages(self, shape: Sequence[int], itemsize: int, current: list[list[int]],
                       d: int, gathered: Axes, staged: bool) -> list[int] | None:
        """With `staged`: the axes to gather from dim `d` one at a time, minor-most
        first, when that is cheaper than XLA's one all-gather over them all; else None.

        A ring all-gather over n devices takes n - 1 steps, so gathering (x, y) as y, then x,
        takes (n_y - 1) + (n_x - 1) steps instead of n_x * n_y - 1 for the same bytes, and only
        the x part crosses x's link when the links differ. Only a minor-most run of the dim's
        axes can be gathered so (each stage leaves a whole-block layout)."""
        if not staged or len(gathered) < 2:
            return None
        axes = current[d]
        if tuple(axes[len(axes) - len(gathered):]) != tuple(sorted(gathered, key=axes.index)):
            return None
        trial = [list(a) for a in current]
        trial[d] = [a for a in axes if a not in gathered]
        whole = self.collective(ALL_GATHER, local_bytes(shape, itemsize, trial, self.mesh),
                                gathered)
        by_stages = 0.0
        trial[d] = list(axes)
        order = list(reversed(axes[len(axes) - len(gathered):]))
        for axis in order:
            trial[d].remove(axis)
            by_stages += self.collective(ALL_GATHER,
                                         local_bytes(shape, itemsize, trial, self.mesh), (axis,))
        return order if by_stages < whole else None
