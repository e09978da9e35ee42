"""Exact reduction of a compiled model before its ILP: groups that only pairwise costs tie to
the rest are eliminated (variable elimination, as in dynamic programming on a chain).

A group is *free* when no memory row can see it (its bytes are the same under every strategy
at each binding point, `Model.binding_points`) and no launch lists it. A free group with

- one strategy, or no pairwise cost: its cheapest strategy is taken, its pairwise costs
  become linear terms of its neighbours;
- one neighbour h: h's linear cost of strategy j gains min_i (cost_i + pair_ij);
- two neighbours h and k: the pair (h, k) gains min_i (cost_i + pair_hi + pair_ik), when
  that pair's transportation grid (strategy classes, `backends.classes`) is no larger than
  the group's binaries and the two grids it replaces;

and once eliminated, its strategy is the minimiser given its neighbours' (among equals, the
one holding the fewest bytes, then the lowest index). Repeated until nothing is eliminated, this removes the chains between the
branch points of a train step's graph (on a 2-layer Flax Llama on 2x4 without a binding memory
row, 268 of 415 groups have at most two neighbours). The reduced ILP has the same optimum, and
its LP relaxation is at least as tight: the eliminated minima are exact, where the LP of the
original could average two layouts along a chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hloplan.solver import backends
from hloplan.solver.model import Group, Launch, Model, separable

__all__ = ["Reduction", "eliminate"]


@dataclass
class Reduction:
    """A reduced model and how to map choices between it and the original."""

    model: Model
    kept: list[int]  # reduced group index -> original group index
    # In elimination order: (group, its neighbours then, minimiser per neighbour strategies).
    steps: list[tuple[int, tuple[int, ...], np.ndarray]]
    size: int  # groups of the original

    @property
    def eliminated(self) -> int:
        return len(self.steps)

    def restrict(self, choice: list[int] | None) -> list[int] | None:
        """An original choice on the kept groups."""
        return None if choice is None else [choice[g] for g in self.kept]

    def expand(self, choice: list[int]) -> list[int]:
        """The original choice of a reduced one: eliminated groups at their minimisers."""
        full = [-1] * self.size
        for r, g in enumerate(self.kept):
            full[g] = int(choice[r])
        for g, others, best in reversed(self.steps):
            full[g] = int(best[tuple(full[h] for h in others)])
        return full


def _cheapest(total: np.ndarray, held: np.ndarray) -> np.ndarray:
    """Per entry of total's other axes, the index along axis 0 of the smallest total: among
    equal totals (to rounding) the one holding the fewest bytes, then the lowest index."""
    low = total.min(axis=0)
    tied = total <= low + 1e-12 * np.abs(low) + 1e-18
    shape = (-1,) + (1,) * (total.ndim - 1)
    return np.argmin(np.where(tied, held.reshape(shape), np.inf), axis=0)


def _grid(matrix: np.ndarray) -> int:
    """Variables of the transportation grid of a pairwise matrix."""
    return len(backends.classes(matrix)) * len(backends.classes(matrix.T))


def eliminate(model: Model, budget: float) -> Reduction:
    """The exact reduction of `model` under `budget` (module docstring)."""
    count = len(model.groups)
    linear = [costs.copy() for costs in model.linear]
    # adjacency[g][h]: the pair matrix oriented rows = g's strategies, columns = h's.
    adjacency: list[dict[int, np.ndarray]] = [{} for _ in range(count)]
    for (a, b), matrix in model.pairs.items():
        adjacency[a][b] = matrix
        adjacency[b][a] = matrix.T
    pinned = {g for launch in model.launches for g in launch.members}
    binding = model.binding_points(budget)
    if binding:
        pinned.update(model.memory.groups_at(binding))
    # Bytes each strategy holds over the program (summed over its memory events): among
    # strategies of equal cost, an eliminated group takes the one holding least.
    held = [vectors.sum(axis=0) for vectors in model.memory.vectors]
    constant = model.constant
    steps: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    alive = [True] * count

    def drop(g: int) -> None:
        alive[g] = False
        for h in adjacency[g]:
            del adjacency[h][g]
        adjacency[g] = {}

    changed = True
    while changed:
        changed = False
        for g in range(count):
            if not alive[g] or g in pinned:
                continue
            neighbours = sorted(adjacency[g])
            size = model.groups[g].size
            if size == 1 or not neighbours:
                for h in neighbours:  # one strategy: its row of each pair is linear
                    linear[h] += adjacency[g][h][0]
                best = _cheapest(linear[g], held[g])
                constant += float(linear[g][int(best)])
                steps.append((g, (), best))
                drop(g)
                changed = True
            elif len(neighbours) == 1:
                (h,) = neighbours
                total = linear[g][:, None] + adjacency[g][h]  # [i, j]
                best = _cheapest(total, held[g])
                linear[h] += total[best, np.arange(total.shape[1])]
                steps.append((g, (h,), best))
                drop(g)
                changed = True
            elif len(neighbours) == 2:
                h, k = neighbours
                total = (linear[g][:, None, None] + adjacency[g][h][:, :, None]
                         + adjacency[g][k][:, None, :])  # [i, j, l]
                best = _cheapest(total, held[g])
                merged = np.take_along_axis(total, best[None], axis=0)[0]
                existing = adjacency[h].get(k)
                if existing is not None:
                    merged = merged + existing
                folds = separable(merged)
                before = size + _grid(adjacency[g][h]) + _grid(adjacency[g][k]) + (
                    _grid(existing) if existing is not None else 0)
                if not folds and _grid(merged) > before:
                    continue
                steps.append((g, (h, k), best))
                drop(g)
                if folds:  # two linear terms (as compile_model folds such pairs)
                    linear[h] += merged[:, 0] - merged[0, 0]
                    linear[k] += merged[0]
                    adjacency[h].pop(k, None)
                    adjacency[k].pop(h, None)
                else:
                    adjacency[h][k] = merged
                    adjacency[k][h] = merged.T
                changed = True
    kept = [g for g in range(count) if alive[g]]
    return Reduction(_reduced(model, kept, linear, adjacency, constant), kept, steps, count)


def _reduced(model: Model, kept: list[int], linear: list[np.ndarray],
             adjacency: list[dict[int, np.ndarray]], constant: float) -> Model:
    position = {g: r for r, g in enumerate(kept)}
    groups = [Group(model.groups[g].nodes, model.groups[g].size) for g in kept]
    group_of = [-1] * len(model.group_of)
    for r, g in enumerate(kept):
        for node in model.groups[g].nodes:
            group_of[node] = r
    pairs = {(position[a], position[b]): matrix
             for a in kept for b, matrix in sorted(adjacency[a].items()) if a < b}
    reduced = Model(groups, group_of, [linear[g] for g in kept], pairs, constant,
                    launches=[Launch(launch.cost, {position[g]: picks
                                                   for g, picks in launch.members.items()})
                              for launch in model.launches])
    reduced.memory = model.memory.subset(kept)
    return reduced
