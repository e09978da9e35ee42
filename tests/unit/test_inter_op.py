"""Alpa's inter-operator DP (stages x submeshes) on plain numbers, against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from hloplan.mesh import MeshSpec
from hloplan.pipeline_parallel.inter_op import (
    StageCost,
    SubmeshShape,
    in_flight,
    objective,
    place,
    solve,
    submesh_shapes,
    submesh_spec,
)


def brute_force(layers, sizes, devices, cost, microbatches, counts, schedule="1f1b",
                budget=float("inf")):
    best = None
    for s in counts:
        for cuts in itertools.combinations(range(1, layers), s - 1):
            bounds = (0, *cuts, layers)
            ranges = list(zip(bounds, bounds[1:]))
            for shapes in itertools.product(range(len(sizes)), repeat=s):
                if sum(sizes[h] for h in shapes) != devices:
                    continue
                costs = [cost(i, j, h) for (i, j), h in zip(ranges, shapes)]
                if any(c is None for c in costs):
                    continue
                if any(c.memory(in_flight(schedule, microbatches, s - k)) > budget
                       for k, c in enumerate(costs)):
                    continue
                value = objective([c.time for c in costs], [c.once for c in costs], microbatches)
                if best is None or value < best[0]:
                    best = (value, ranges, shapes)
    return best


def random_cost(seed, layers, sizes):
    """Layer work that shrinks with devices at a random efficiency, a random fixed cost per
    stage (transfers), a once-per-step part, and memory growing with the range."""
    rng = random.Random(seed)
    work = [rng.uniform(1, 10) for _ in range(layers)]
    efficiency = {h: rng.uniform(0.5, 1.0) for h in range(len(sizes))}
    overhead = {(i, j): rng.uniform(0, 2) for i in range(layers) for j in range(layers + 1)}
    table = {}
    for i in range(layers):
        for j in range(i + 1, layers + 1):
            for h, size in enumerate(sizes):
                if rng.random() < 0.05:
                    table[(i, j, h)] = None
                    continue
                w = sum(work[i:j])
                table[(i, j, h)] = StageCost(
                    time=w / (size ** efficiency[h]) + overhead[(i, j)],
                    once=w / size * 0.3,
                    peak=w / size, residual=w / size / 4)
    return lambda i, j, h: table[(i, j, h)]


@pytest.mark.parametrize("seed", range(12))
def test_dp_optimum_equals_brute_force(seed):
    rng = random.Random(100 + seed)
    layers = rng.randint(2, 6)
    sizes = [1, 2, 4, 8]
    devices = 8
    cost = random_cost(seed, layers, sizes)
    microbatches = rng.choice([1, 2, 4, 8])
    schedule = rng.choice(["1f1b", "gpipe"])
    counts = range(1, 5) if seed % 3 else [rng.randint(1, min(layers, 4))]
    budget = rng.choice([float("inf"), 6.0, 10.0])
    want = brute_force(layers, sizes, devices, cost, microbatches, counts, schedule, budget)
    got = solve(layers, sizes, devices, cost, microbatches, counts, schedule, budget)
    if want is None:
        assert got is None
        return
    assert got is not None
    assert got.objective == pytest.approx(want[0], rel=1e-12)
    # The solution it returns has the objective it claims, and is legal.
    costs = [cost(s.start, s.end, s.shape) for s in got.stages]
    assert got.stages[0].start == 0 and got.stages[-1].end == layers
    assert all(a.end == b.start for a, b in zip(got.stages, got.stages[1:]))
    assert sum(sizes[s.shape] for s in got.stages) == devices
    assert objective([c.time for c in costs], [c.once for c in costs], microbatches) == \
        pytest.approx(got.objective, rel=1e-12)
    # Below the bound only: the same problem bounded by its own optimum has no solution.
    assert solve(layers, sizes, devices, cost, microbatches, counts, schedule, budget,
                 bound=got.objective) is None


def test_one_heavy_layer_gets_the_bigger_submesh():
    # Layer 0 costs 4, layers 1 and 2 cost 1 each, all scale perfectly: on 8 devices with 3
    # stages the optimum gives the heavy layer 4 devices and each light layer 2 (1 + 0.5 + 0.5
    # per microbatch, the slowest 1: 2 + (M-1) * 1).
    work = [4.0, 1.0, 1.0]
    sizes = [1, 2, 4, 8]
    got = solve(3, sizes, 8, lambda i, j, h: StageCost(sum(work[i:j]) / sizes[h]), 4, [3])
    assert [(s.start, s.end, sizes[s.shape]) for s in got.stages] == [(0, 1, 4), (1, 2, 2),
                                                                     (2, 3, 2)]
    assert got.objective == pytest.approx(2 + 3 * 1.0)


def test_once_per_step_part_counts_its_slowest_stage():
    # Two layers; one stage or two on 2 devices. Per-microbatch times favour two stages a
    # little, but a stage on one device runs the whole optimizer of its layer alone.
    sizes = [1, 2]

    def cost(i, j, h):
        return StageCost(time=(j - i) / sizes[h], once=(j - i) * 3.0 / sizes[h])

    # One stage: 2 * (2/2) ... M=1: t = 1, once = 3 -> 4. Two stages: t = 1 + 1, once 3 -> 5.
    got = solve(2, sizes, 2, cost, 1, [1, 2])
    assert len(got.stages) == 1 and got.objective == pytest.approx(4.0)


def test_submesh_shapes_and_placement():
    mesh = MeshSpec(("x", "y"), (4, 8))
    shapes = submesh_shapes(mesh)
    assert [str(s) for s in shapes] == ["1x1", "1x2", "1x4", "1x8", "2x8", "3x8", "4x8"]
    assert submesh_spec(mesh, SubmeshShape(2, 8)) == MeshSpec(("x", "y"), (2, 8))
    assert submesh_spec(mesh, SubmeshShape(1, 4)) == MeshSpec(("y",), (4,))
    assert submesh_spec(mesh, SubmeshShape(1, 8)) == MeshSpec(("y",), (8,))
    assert submesh_spec(mesh, SubmeshShape(1, 1)) == MeshSpec(("y",), (1,))
    # In stage order where it fits: the two row parts share row 0, the 3 rows follow.
    placed = place(mesh, [SubmeshShape(1, 4), SubmeshShape(3, 8), SubmeshShape(1, 4)])
    assert placed == [[0, 1, 2, 3], list(range(8, 32)), [4, 5, 6, 7]]
    assert sorted(d for p in placed for d in p) == list(range(32))
    # A 1-D mesh: every stage is some rows of it.
    line = MeshSpec(("x",), (8,))
    assert [s.size for s in submesh_shapes(line)] == list(range(1, 9))
    assert place(line, [SubmeshShape(4, 1), SubmeshShape(2, 1), SubmeshShape(2, 1)]) == [
        [0, 1, 2, 3], [4, 5], [6, 7]]
    # A row split over two axes.
    mesh3 = MeshSpec(("a", "b", "c"), (2, 2, 4))
    assert submesh_spec(mesh3, SubmeshShape(1, 8)) == MeshSpec(("b", "c"), (2, 4))
    assert submesh_spec(mesh3, SubmeshShape(1, 2)) == MeshSpec(("c",), (2,))


@pytest.mark.parametrize("seed", range(20))
def test_any_choice_of_shapes_that_adds_up_is_placed(seed):
    rng = random.Random(seed)
    mesh = MeshSpec(("x", "y"), (rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 4, 8])))
    shapes = submesh_shapes(mesh)
    left, chosen = mesh.size, []
    while left:
        shape = rng.choice([s for s in shapes if s.size <= left])
        chosen.append(shape)
        left -= shape.size
    placed = place(mesh, chosen)
    assert sorted(d for p in placed for d in p) == list(range(mesh.size))
    assert [len(p) for p in placed] == [s.size for s in chosen]
