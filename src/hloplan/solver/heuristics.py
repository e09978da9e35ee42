"""Heuristics around the ILP: a feasible start, LP rounding and repair, dives, and
neighbourhood search.

They work on a compiled model (`model.py`) and never change what is optimal: each returns a
choice that fits the budget (checked with `Model.fits`), which the solver uses as its incumbent
or returns when branch and bound finds nothing better in time.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import pulp

from hloplan.solver import backends
from hloplan.solver.backends import INTEGRALITY_TOL, SolverError
from hloplan.solver.evaluate import MEMORY_RTOL
from hloplan.solver.model import Model, ModelInfeasible

__all__ = ["DIVE_FRACTION", "NEIGHBOURHOOD_MAX_FRACTION", "dive", "feasible_start",
           "follow_flows", "fractional_groups", "free_windows", "improve", "repair",
           "search_neighbourhoods"]

# The rounded LP relaxation is repaired by at most this many single-group moves (it is usually
# a few bytes over at a handful of points; when it is far off, the solver does better).
_REPAIR_MOVES = 64
# Neighbourhood search (RINS) after a fractional LP: at most this many rounds, each solving
# the sub-ILP of at most this fraction of the groups (a bigger one is as hard as the whole).
_NEIGHBOURHOOD_ROUNDS = 3
NEIGHBOURHOOD_MAX_FRACTION = 0.25
# A fractional LP with more free groups than that is searched a window at a time, at most this
# many windows per round.
_NEIGHBOURHOOD_WINDOWS = 8
# LP dives when most groups are fractional: fix this fraction of the fractional groups, solve
# the LP again; at most this many LPs. Fixing fewer spoils less (GPT 2 layers on 8x8, one LP
# after fixing 1/2, 1/4, 1/64: 0.7%, 0.5%, 0.01% above the bound) but each LP takes longer.
DIVE_FRACTION = 0.25
_DIVE_ROUNDS = 4
# Flow rounding: at most this many roundings (a start group and strategy each), of which the
# cheapest this many are improved by local search.
_FLOW_CANDIDATES = 256
_FLOW_IMPROVED = 32
# ... and of those, at most this many that break the budget are repaired (a repair costs
# about as much as a hundred roundings on a memory-tight Llama3-8B step).
_FLOW_REPAIRED = 2


def improve(model: Model, budget: float, choice: list[int]) -> None:
    """Best-improvement local search over single groups, keeping every point under budget."""
    neighbours = model.neighbours()
    memory = model.memory
    check = memory.count > 0 and not math.isinf(budget)
    limit = budget + MEMORY_RTOL * abs(budget)
    runs = []  # per group: run starts and ends (interleaved) and coefficients, one row per run
    for segments in (memory.segments() if check else [[] for _ in model.groups]):
        bounds = np.array([b for start, stop, _ in segments for b in (start, stop)],
                          dtype=np.int64)
        vectors = np.array([v for _, _, v in segments]) if segments else None
        runs.append((bounds, vectors))
    loads = memory.choice_loads(choice) if check else np.zeros(0)

    for _ in range(4):
        improved = False
        for g in range(len(model.groups)):
            current = choice[g]
            costs = model.local_costs(neighbours, g, choice)
            threshold = costs[current] - 1e-15 * abs(costs[current])
            better = costs < threshold
            if not better.any():
                continue
            bounds, vectors = runs[g]
            if vectors is not None:
                # The peak of each run where the group is live, and what each strategy adds.
                peaks = np.maximum.reduceat(np.append(loads, -np.inf), bounds)[0::2]
                better &= ((peaks[:, None] + vectors - vectors[:, [current]]) <= limit).all(0)
            candidates = np.flatnonzero(better)
            if not len(candidates):
                continue
            best = int(candidates[np.argmin(costs[candidates])])
            if vectors is not None:
                for k in range(len(vectors)):
                    loads[bounds[2 * k]:bounds[2 * k + 1]] += vectors[k, best] - vectors[k, current]
            choice[g] = best
            improved = True
        if not improved:
            return


def feasible_start(model: Model, budget: float, relaxed=None) -> list[int] | None:
    """A feasible start for the solver (and a fallback if it finds nothing), or None.

    Tries, in turn, the rounded LP relaxation (`relaxed`: a value vector per group), each
    group's cheapest strategy, and each group's smallest (then cheapest) strategy over the
    binding points; the first that fits is improved by local search.
    """
    candidates = []
    if relaxed is not None:
        candidates.append([int(np.argmax(values)) for values in relaxed])
    candidates.append([int(np.argmin(costs)) for costs in model.linear])
    binding = model.binding_points(budget)
    if binding:
        # Each group's bytes summed over the binding points, per strategy.
        counts = np.zeros(model.memory.count + 1)
        counts[1:][binding] = 1.0
        counts = np.cumsum(counts)  # counts[p]: binding points before p
        memory = [np.zeros(g.size) for g in model.groups]
        for g, runs in enumerate(model.memory.segments()):
            for start, stop, vector in runs:
                memory[g] += (counts[stop] - counts[start]) * vector
        candidates.append([
            min(range(g.size), key=lambda i, k=k: (memory[k][i], model.linear[k][i]))
            for k, g in enumerate(model.groups)
        ])
    for k, choice in enumerate(candidates):
        if model.fits(budget, choice) or (k == 0 and relaxed is not None
                                             and repair(model, budget, choice)):
            improve(model, budget, choice)
            return choice
    return None


def repair(model: Model, budget: float, choice: list[int]) -> bool:
    """Move groups to smaller strategies until every point fits (in place); False if stuck.

    Each step takes the move with the least added seconds per byte of overflow removed at the
    points over budget. Repairs a rounded LP relaxation, which sits on the budget: rounding
    its few fractional groups up usually leaves a point a little over.
    """
    memory = model.memory
    limit = budget + MEMORY_RTOL * abs(budget)
    segments = memory.segments()
    bounds = [(np.array([a for a, _, _ in runs], dtype=np.int64),
               np.array([b for _, b, _ in runs], dtype=np.int64)) for runs in segments]
    loads = memory.choice_loads(choice)
    neighbours = model.neighbours()
    for _ in range(min(2 * len(model.groups) + 1, _REPAIR_MOVES)):
        over = loads - limit
        violated = np.flatnonzero(over > 0)
        if not len(violated):
            return True
        best = None
        for g, group in enumerate(model.groups):
            if not segments[g]:
                continue
            current = choice[g]
            lows = np.searchsorted(violated, bounds[g][0])
            highs = np.searchsorted(violated, bounds[g][1])
            touching = np.flatnonzero(highs > lows)
            if not len(touching):
                continue
            gain = np.zeros(group.size)
            for k in touching.tolist():
                excess = over[violated[lows[k]:highs[k]]]
                vector = segments[g][k][2]
                delta = vector - vector[current]
                gain += excess.sum() - np.maximum(excess[:, None] + delta[None, :], 0.0).sum(0)
            useful = np.flatnonzero(gain > 0)
            if not len(useful):
                continue
            costs = model.local_costs(neighbours, g, choice)
            ratios = (costs[useful] - costs[current]) / gain[useful]
            k = int(np.argmin(ratios))
            if best is None or ratios[k] < best[0]:
                best = (float(ratios[k]), g, int(useful[k]))
        if best is None:
            return False
        _, g, i = best
        for start, stop, vector in segments[g]:
            loads[start:stop] += vector[i] - vector[choice[g]]
        choice[g] = i
    return bool((loads <= limit).all())


def search_neighbourhoods(
    model: Model,
    budget: float,
    relaxed: list[np.ndarray],
    incumbent: list[int],
    deadline: float,
    solve_sub: Callable[[Model, list[int]], list[int]],
) -> tuple[list[int] | None, int]:
    """Improve a fitting `incumbent` by solving small sub-ILPs exactly (RINS: the groups where
    the LP relaxation is fractional or disagrees with the incumbent, and their neighbours
    through pairwise costs, are free; all others keep the incumbent's strategy). On a
    Llama3-8B step the LP is fractional in one tied group, and the neighbourhood of 12 groups
    solves in 0.1 s to the plan that branch and bound takes seconds to find. When the free
    groups are more than a quarter of the problem (a GPT whose LP splits most groups 0.5/0.5),
    they are freed a window at a time (`free_windows`), each window's sub-ILP solved in turn.
    `solve_sub(sub, start)`: the best choice of a restriction of `model` (`start` fits it), or
    ModelInfeasible / SolverError.

    Returns the best choice found (None when nothing better) and the number of sub-ILPs
    solved."""
    neighbours = model.neighbours()
    rounded = [int(np.argmax(values)) for values in relaxed]
    best, best_objective = None, model.objective(incumbent)
    current = list(incumbent)
    rounds = 0
    cap = max(1, int(NEIGHBOURHOOD_MAX_FRACTION * len(model.groups)))
    for _ in range(_NEIGHBOURHOOD_ROUNDS):
        seeds = [g for g, values in enumerate(relaxed)
                 if values[current[g]] < 1.0 - INTEGRALITY_TOL or current[g] != rounded[g]]
        improved = False
        for free in free_windows(seeds, neighbours, cap)[:_NEIGHBOURHOOD_WINDOWS]:
            if time.perf_counter() >= deadline:
                break
            allowed = [np.arange(group.size) if g in free else np.array([current[g]])
                       for g, group in enumerate(model.groups)]
            sub = model.restrict(allowed)
            rounds += 1
            try:
                found = solve_sub(sub, [current[g] if g in free else 0
                                        for g in range(len(model.groups))])
            except (ModelInfeasible, SolverError):
                continue
            choice = [int(keep[i]) for keep, i in zip(allowed, found, strict=True)]
            if not model.fits(budget, choice):
                continue
            improve(model, budget, choice)
            objective = model.objective(choice)
            if objective < best_objective - 1e-12 * abs(best_objective):
                best, best_objective, current, improved = choice, objective, choice, True
        if not improved:
            break
    return best, rounds


def follow_flows(model: Model, budget: float, built: backends.Built) -> list[int] | None:
    """Round a fractional LP along its pair variables: fix one group's strategy, then, in
    breadth-first order over pairwise costs, give each next group the strategy that most of
    the LP's flow from its already-fixed neighbours goes to. An LP that averages a few
    consistent layouts (a 2-layer Flax Llama on 2x4 splits most groups 0.2/0.4/0.4) is then
    followed along one of them, where rounding each group on its own mixes them (10,030 us
    against the LP's 8,539; followed and improved: 8,596). One rounding per start group and
    strategy the LP uses (fractional groups in order, at most _FLOW_CANDIDATES); the
    cheapest _FLOW_IMPROVED are improved by local search (the first _FLOW_REPAIRED that break
    the budget repaired first, the others skipped). Returns the best that fits."""
    values = backends.group_values(built)
    if values is None or not built.e:
        return None
    neighbours: list[list[tuple[int, np.ndarray]]] = [[] for _ in model.groups]
    for (a, b), (grid, row_classes, col_classes) in built.e.items():
        # The flow between strategies: each class pair's flow shared among its members in
        # proportion to their own LP values.
        flow = np.zeros((model.groups[a].size, model.groups[b].size))
        rows = [_shares(values[a], members) for members in row_classes]
        cols = [_shares(values[b], members) for members in col_classes]
        for i, line in enumerate(grid):
            for j, column in enumerate(line):
                amount = built.values[column]
                if amount > INTEGRALITY_TOL:
                    flow[np.ix_(row_classes[i], col_classes[j])] += amount * np.outer(
                        rows[i], cols[j])
        neighbours[a].append((b, flow.T))  # oriented [other's strategy, this group's]
        neighbours[b].append((a, flow))
    candidates = []
    for start in fractional_groups(values):
        for pick in np.flatnonzero(values[start] > INTEGRALITY_TOL).tolist():
            if len(candidates) >= _FLOW_CANDIDATES:
                break
            choice = _follow(model, values, neighbours, start, pick)
            candidates.append((model.objective(choice), len(candidates), choice))
    candidates.sort(key=lambda c: (c[0], c[1]))
    best, best_objective = None, math.inf
    repairs = 0
    for _, _, choice in candidates[:_FLOW_IMPROVED]:
        fits = model.fits(budget, choice)
        if not fits and repairs < _FLOW_REPAIRED:
            repairs += 1
            fits = repair(model, budget, choice)
        if fits:
            improve(model, budget, choice)
            objective = model.objective(choice)
            if objective < best_objective:
                best, best_objective = choice, objective
    return best


def _shares(values: np.ndarray, members: list[int]) -> np.ndarray:
    weights = values[members].clip(min=0.0)
    total = weights.sum()
    return weights / total if total > 0 else np.full(len(members), 1.0 / len(members))


def _follow(model: Model, values: list[np.ndarray], neighbours, start: int,
            pick: int) -> list[int]:
    """One flow rounding (follow_flows) from group `start` at strategy `pick`; groups no pair
    reaches from it start their own search at their largest LP value."""
    choice = [-1] * len(model.groups)
    for root in [start, *range(len(model.groups))]:
        if choice[root] >= 0:
            continue
        choice[root] = pick if root == start else int(np.argmax(values[root]))
        queue = deque([root])
        while queue:
            g = queue.popleft()
            for h, _ in neighbours[g]:
                if choice[h] >= 0:
                    continue
                score = 1e-9 * values[h]  # ties: the larger LP value
                for other, flow in neighbours[h]:
                    if choice[other] >= 0:
                        row = flow[choice[other]]
                        total = row.sum()
                        if total > INTEGRALITY_TOL:
                            score = score + row / total
                choice[h] = int(np.argmax(score))
                queue.append(h)
    return choice


def fractional_groups(relaxed: list[np.ndarray]) -> list[int]:
    """The groups (in order) whose LP values are not one-hot."""
    return [g for g, values in enumerate(relaxed) if values.max() < 1.0 - INTEGRALITY_TOL]


def dive(
    model: Model,
    budget: float,
    backend: str,
    deadline: float,
    threads: int,
    lazy: bool,
    relaxed: list[np.ndarray],
) -> tuple[list[int] | None, int]:
    """Round a fractional LP by diving: fix a quarter of the fractional groups (in program
    order) to their largest value, solve the LP of the rest again, and repeat until it comes
    out integral. Fixing part of an LP that splits most groups 0.5/0.5 between two layouts
    lets the re-solve pick the matching layouts for the others, which rounding each group on
    its own cannot (GPT 2 layers on 8x8: 485 of 568 groups fractional; rounded 1.8% above the
    LP bound, after one dive 0.5%). Rounding guided by the neighbours' choices, or by the
    LP's pair variables, did worse than plain rounding there.

    Returns the best fitting choice found (improved by local search) and the LPs solved."""
    fixed: dict[int, int] = {}
    values = relaxed
    best, best_objective, solved = None, math.inf, 0
    for _ in range(_DIVE_ROUNDS):
        fractional = [g for g in fractional_groups(values) if g not in fixed]
        if not fractional or time.perf_counter() >= deadline:
            break
        for g in fractional[:max(1, int(DIVE_FRACTION * len(fractional)))]:
            fixed[g] = int(np.argmax(values[g]))
        allowed = [np.array([fixed[g]]) if g in fixed else np.arange(group.size)
                   for g, group in enumerate(model.groups)]
        sub = model.restrict(allowed)
        binding = sub.binding_points(budget)
        built = backends.build(sub, binding, budget, backend, lazy)
        backends.seed_rows(built, budget, binding)
        solved += 1
        if (backends.run_lazy(built, backend, budget, deadline, threads, mip=False)
                != pulp.LpSolutionOptimal):
            break
        sub_values = backends.group_values(built)
        values = []
        for keep, group, v in zip(allowed, model.groups, sub_values, strict=True):
            full = np.zeros(group.size)
            full[keep] = v
            values.append(full)
        choice = [int(np.argmax(v)) for v in values]
        if model.fits(budget, choice) or repair(model, budget, choice):
            improve(model, budget, choice)
            objective = model.objective(choice)
            if objective < best_objective:
                best, best_objective = choice, objective
    return best, solved


def free_windows(seeds: list[int], neighbours, cap: int) -> list[set[int]]:
    """The groups to free around `seeds`: one set when the seeds and their neighbours number
    at most `cap`, else consecutive windows of seeds (program order keeps a window's groups
    near each other in the graph), each with its seeds' neighbours, of at most about `cap`."""
    windows: list[set[int]] = []
    window: set[int] = set()
    for g in seeds:
        block = {g, *(other for other, _, _ in neighbours[g])}
        if window and len(window | block) > cap:
            windows.append(window)
            window = set()
        window |= block
    if window:
        windows.append(window)
    return windows

