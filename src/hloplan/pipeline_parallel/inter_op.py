"""Alpa's inter-operator pass on plain numbers: which contiguous ranges of layers form the
pipeline stages, and which submesh each stage runs on.

Zheng et al., "Alpa" (OSDI'22), sec. 5.2: with L layers, M microbatches and stage s covering
layers [i, j) on a submesh of shape h, costing t(i, j, h) seconds per microbatch, the pipeline
takes

    sum_s t_s + (M - 1) * max_s t_s

and the submeshes must tile the device mesh. Alpa enumerates the bound t_max and runs a DP
minimising the sum under it; here the DP keeps, per state, the Pareto front of (sum of stage
times, largest stage time, largest once-per-step time), which gives the same optimum in one pass
(the objective is increasing in all three) and also prices the once-per-step part (the optimizer
update of each stage's parameters, run by all stages at once: the slowest counts).

State: (first layer k, stages left r, devices left d); a stage's memory is checked with the
number of microbatches it holds at once, which depends on r (1F1B: min(M, r); GPipe: M).

Submesh shapes (Alpa's set, on the logical mesh): the mesh is rows x width, rows = the first
axis, width = the product of the others. A stage takes n whole rows (n, width), or a
power-of-two part of one row (1, 2^k) with 2^k dividing width. Any choice of such shapes whose
sizes add up to the mesh tiles it (`place`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from hloplan.mesh import MeshSpec

INF = float("inf")


@dataclass(frozen=True, order=True)
class SubmeshShape:
    rows: int  # along the mesh's first axis
    cols: int  # devices within one row: the whole row, or a power-of-two part of it

    @property
    def size(self) -> int:
        return self.rows * self.cols

    def __str__(self) -> str:
        return f"{self.rows}x{self.cols}"


def mesh_rows(mesh: MeshSpec) -> tuple[int, int]:
    """(rows, width): the first axis, and the devices in one row."""
    return mesh.axis_sizes[0], math.prod(mesh.axis_sizes[1:])


def submesh_shapes(mesh: MeshSpec) -> list[SubmeshShape]:
    """Alpa's candidate shapes, smallest first: (1, 2^k) within a row, (n, width) for n rows."""
    rows, width = mesh_rows(mesh)
    shapes = []
    k = 1
    while k < width:
        if width % k == 0 and _row_part(mesh, k) is not None:
            shapes.append(SubmeshShape(1, k))
        k *= 2
    shapes.extend(SubmeshShape(n, width) for n in range(1, rows + 1))
    return sorted(set(shapes), key=lambda s: (s.size, s.rows))


def _row_part(mesh: MeshSpec, cols: int) -> list[tuple[str, int]] | None:
    """The axes of `cols` consecutive devices of a row: the trailing axes whole, then a part of
    the next one (None when `cols` does not split the row's axes that way)."""
    out: list[tuple[str, int]] = []
    left = cols
    for name, size in reversed(list(zip(mesh.axis_names[1:], mesh.axis_sizes[1:]))):
        if left == 1:
            break
        if left % size == 0:
            out.append((name, size))
            left //= size
        elif size % left == 0:
            out.append((name, left))
            left = 1
        else:
            return None
    if left != 1:
        return None
    return list(reversed(out))


def submesh_spec(mesh: MeshSpec, shape: SubmeshShape) -> MeshSpec:
    """The stage's own mesh: axes of size 1 dropped (a single device keeps the last axis, size 1)."""
    rows, width = mesh_rows(mesh)
    if shape.cols == width:
        axes = list(zip(mesh.axis_names, (shape.rows, *mesh.axis_sizes[1:])))
    else:
        axes = _row_part(mesh, shape.cols) or []
    axes = [(n, s) for n, s in axes if s > 1]
    if not axes:
        axes = [(mesh.axis_names[-1], 1)]
    return MeshSpec(tuple(n for n, _ in axes), tuple(s for _, s in axes))


def place(mesh: MeshSpec, shapes: Sequence[SubmeshShape]) -> list[list[int]]:
    """Device positions (row-major in the full mesh) of each stage's submesh, in stage order.

    Stages are placed in order where they fit (whole-row shapes on the first free rows, row
    parts at the first free aligned offset), so neighbouring stages tend to be neighbours on
    the mesh. Should that leave no room, placing the largest first always succeeds: each row
    part's size divides the row and every larger part's size, so parts never straddle rows."""
    rows, width = mesh_rows(mesh)
    if sum(s.size for s in shapes) != rows * width:
        raise ValueError(f"submeshes of {sum(s.size for s in shapes)} devices do not tile "
                         f"{rows * width}")
    placed = _place(rows, width, list(enumerate(shapes)))
    if placed is None:
        order = sorted(enumerate(shapes), key=lambda item: (-item[1].size, item[0]))
        placed = _place(rows, width, order)
    if placed is None:  # not reachable for Alpa's shapes
        raise ValueError(f"cannot place submeshes {[str(s) for s in shapes]} on {rows}x{width}")
    return placed


def _place(rows: int, width: int, items) -> list[list[int]] | None:
    used = [[False] * width for _ in range(rows)]
    out: list[list[int]] = [[] for _ in items]
    for index, shape in items:
        if shape.cols == width:
            free = [r for r in range(rows) if not any(used[r])]
            if len(free) < shape.rows:
                return None
            # Prefer consecutive rows.
            chosen = next((free[i:i + shape.rows] for i in range(len(free) - shape.rows + 1)
                           if free[i + shape.rows - 1] - free[i] == shape.rows - 1),
                          free[:shape.rows])
            for r in chosen:
                used[r] = [True] * width
            out[index] = [r * width + c for r in chosen for c in range(width)]
            continue
        spot = None
        partial = [r for r in range(rows) if any(used[r]) and not all(used[r])]
        for r in partial + [r for r in range(rows) if not any(used[r])]:
            for c in range(0, width - shape.cols + 1, shape.cols):
                if not any(used[r][c:c + shape.cols]):
                    spot = (r, c)
                    break
            if spot:
                break
        if spot is None:
            return None
        r, c = spot
        for k in range(c, c + shape.cols):
            used[r][k] = True
        out[index] = [r * width + k for k in range(c, c + shape.cols)]
    return out


# ------------------------------------------------------------------------------ the DP


@dataclass(frozen=True)
class StageCost:
    """One candidate stage: layers [i, j) on one submesh shape."""

    time: float  # seconds per microbatch (its tasks, plus receiving from other stages)
    once: float = 0.0  # seconds once per step (its share of the optimizer)
    peak: float = 0.0  # bytes per device: the largest of its tasks' peaks
    residual: float = 0.0  # bytes per device kept per microbatch in flight (activations)
    exact: bool = True  # False: a lower bound, not yet planned

    def memory(self, in_flight: int) -> float:
        return self.peak + self.residual * max(in_flight - 1, 0)


@dataclass(frozen=True)
class Stage:
    start: int  # first layer
    end: int  # one past the last layer
    shape: int  # index into the shapes


@dataclass(frozen=True)
class InterOpSolution:
    objective: float
    stages: tuple[Stage, ...]
    sum_time: float
    max_time: float
    max_once: float


def objective(times: Iterable[float], onces: Iterable[float], microbatches: int) -> float:
    times = list(times)
    return sum(times) + (microbatches - 1) * max(times, default=0.0) + max(onces, default=0.0)


def in_flight(schedule: str, microbatches: int, stages_left: int) -> int:
    """Microbatches a stage holds at once when `stages_left` stages (itself included) remain."""
    return microbatches if schedule == "gpipe" else min(microbatches, stages_left)


def solve(layers: int, sizes: Sequence[int], devices: int,
          cost: Callable[[int, int, int], StageCost | None], microbatches: int,
          stage_counts: Iterable[int], schedule: str = "1f1b", budget: float = INF,
          bound: float = INF) -> InterOpSolution | None:
    """The partition of layers [0, layers) into contiguous stages, each on a submesh of one of
    the shapes (`sizes[h]` devices), using exactly `devices` devices, minimising
    sum t + (M-1) max t + max once, with every stage's memory within `budget`; the number of
    stages is one of `stage_counts`. `cost(i, j, h)` is None where a stage cannot run. Only
    solutions below `bound` are returned (None if there is none)."""
    counts = sorted({s for s in stage_counts if 1 <= s <= min(layers, devices)})
    if not counts:
        return None
    max_stages = counts[-1]
    m1 = microbatches - 1
    table = [[[cost(i, j, h) if j > i else None for h in range(len(sizes))]
              for j in range(layers + 1)] for i in range(layers)]
    smallest = min(sizes)
    largest = max(sizes)
    # front[(k, r, d)]: Pareto-optimal (sum_t, max_t, max_once, stage, child index) for layers
    # [k, layers) in r stages on d devices.
    front: dict[tuple[int, int, int], list[tuple]] = {(layers, 0, 0): [(0.0, 0.0, 0.0, None, -1)]}
    for k in range(layers - 1, -1, -1):
        for r in range(1, min(max_stages, layers - k) + 1):
            flight = in_flight(schedule, microbatches, r)
            for d in range(r * smallest, min(devices, r * largest) + 1):
                entries = []
                for j in range(k + 1, layers - (r - 1) + 1):
                    row = table[k][j]
                    for h, size in enumerate(sizes):
                        rest = d - size
                        if rest < (r - 1) * smallest or rest > (r - 1) * largest:
                            continue
                        c = row[h]
                        if c is None or c.memory(flight) > budget:
                            continue
                        child = front.get((j, r - 1, rest))
                        if not child:
                            continue
                        for index, (st, mt, mo, _, _) in enumerate(child):
                            st2 = st + c.time
                            mt2 = mt if mt >= c.time else c.time
                            mo2 = mo if mo >= c.once else c.once
                            if st2 + m1 * mt2 + mo2 >= bound:
                                continue
                            entries.append((st2, mt2, mo2, Stage(k, j, h), index))
                if entries:
                    front[(k, r, d)] = _pareto(entries)
    best = None
    for s in counts:
        for entry in front.get((0, s, devices), []):
            value = entry[0] + m1 * entry[1] + entry[2]
            if value < bound and (best is None or value < best[0]):
                best = (value, s, entry)
    if best is None:
        return None
    value, r, top = best
    stages = []
    entry, d = top, devices
    while entry[3] is not None:
        stage = entry[3]
        stages.append(stage)
        r, d = r - 1, d - sizes[stage.shape]
        entry = front[(stage.end, r, d)][entry[4]]
    return InterOpSolution(value, tuple(stages), top[0], top[1], top[2])


def _pareto(entries: list[tuple]) -> list[tuple]:
    """The entries no other entry beats on all of (sum_t, max_t, max_once)."""
    entries.sort(key=lambda e: (e[0], e[1], e[2]))
    kept: list[tuple] = []
    for e in entries:
        if any(k[1] <= e[1] and k[2] <= e[2] for k in kept):
            continue
        kept.append(e)
    return kept


__all__ = ["InterOpSolution", "Stage", "StageCost", "SubmeshShape", "in_flight", "mesh_rows",
           "objective", "place", "solve", "submesh_shapes", "submesh_spec"]
