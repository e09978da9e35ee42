"""The sharding problem as plain data.

Independent of MLIR and of PuLP: the ILP builder (`ilp.py`), the evaluator that recomputes a
solution's cost (`evaluate.py`) and the explainer (`explain.py`) all read this.

A node is one decision: which strategy to use for one value (or a group of values tied together,
e.g. an elementwise op that follows its producer). An edge carries the cost of resharding the
source node's output into the layout the destination node's strategy expects. Memory is checked at
program points: the sum, over the nodes live there, of the chosen strategy's per-device bytes, plus
bytes that no decision changes, must stay under the budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Strategy:
    """One way to compute a node, with its costs in seconds and its output bytes per device."""

    name: str
    compute_cost: float = 0.0
    communication_cost: float = 0.0
    memory: float = 0.0
    # Collectives this strategy itself issues: (kind, mesh-axes label, bytes per device).
    collectives: tuple[tuple[str, str, float], ...] = ()

    @property
    def cost(self) -> float:
        return self.compute_cost + self.communication_cost


@dataclass(frozen=True)
class Node:
    name: str
    strategies: tuple[Strategy, ...]
    # Human-readable provenance (op names, source locations) for explain.
    members: tuple[str, ...] = ()
    # Nodes sharing a non-None tie id must choose the same strategy index (repeated layers).
    tie: int | None = None


@dataclass(frozen=True)
class Edge:
    src: int
    dst: int
    # costs[i][j]: seconds to reshard src's output under strategy i for dst's strategy j.
    costs: tuple[tuple[float, ...], ...]
    label: str = ""


@dataclass(frozen=True)
class LivePoint:
    """A program point where memory is checked."""

    nodes: tuple[int, ...]
    fixed_bytes: float = 0.0
    label: str = ""


@dataclass(frozen=True)
class ShardingProblem:
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...] = ()
    live_points: tuple[LivePoint, ...] = ()
    memory_budget: float = float("inf")
    name: str = "problem"

    def validate(self) -> None:
        """Raise ValueError on a malformed problem (sizes that do not agree)."""
        for index, node in enumerate(self.nodes):
            if not node.strategies:
                raise ValueError(f"node {index} ({node.name}) has no strategy")
        for edge in self.edges:
            for end in (edge.src, edge.dst):
                if not 0 <= end < len(self.nodes):
                    raise ValueError(f"edge {edge.label!r} refers to node {end}")
            rows = len(self.nodes[edge.src].strategies)
            cols = len(self.nodes[edge.dst].strategies)
            if len(edge.costs) != rows or any(len(row) != cols for row in edge.costs):
                raise ValueError(f"edge {edge.src}->{edge.dst} cost matrix is not {rows}x{cols}")
        ties: dict[int, int] = {}
        for node in self.nodes:
            if node.tie is not None:
                count = ties.setdefault(node.tie, len(node.strategies))
                if count != len(node.strategies):
                    raise ValueError(f"tie group {node.tie} mixes strategy counts")
        for point in self.live_points:
            for index in point.nodes:
                if not 0 <= index < len(self.nodes):
                    raise ValueError(f"live point {point.label!r} refers to node {index}")


@dataclass(frozen=True)
class Solution:
    """A strategy index per node."""

    choice: tuple[int, ...]


@dataclass(frozen=True)
class SolveStats:
    solver: str
    status: str  # "optimal", "time_limit" (feasible, not proven), "infeasible", ...
    objective: float
    bound: float
    gap: float
    seconds: float
    variables: int
    constraints: int
    extra: dict = field(default_factory=dict)
