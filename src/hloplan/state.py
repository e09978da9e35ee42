"""What the compile pipeline carries from pass to pass, and the pass protocol."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from hloplan.cost_models import CommModel, DeviceModel
from hloplan.diagnostics import DiagnosticLog
from hloplan.graph import Graph
from hloplan.mesh import MeshSpec
from hloplan.solver.problem import ShardingProblem, Solution, SolveStats
from hloplan.strategies import OpStrategy


@dataclass(frozen=True)
class CompileOptions:
    mesh: MeshSpec
    device: DeviceModel
    memory_budget: float | None = None  # bytes per device; None: the device's memory
    time_limit: float = 60.0
    solver: str = "auto"
    hosts: int | None = None
    # Big problems on meshes of 3+ axes are planned on two-axis views and improved two axes at
    # a time (solver/axes.py): "auto" (when the whole ILP would be too big), "always", "never".
    decompose: str = "auto"
    # Planning stops once the plan is proven within this fraction of the optimum (the cost
    # model is no more accurate than ~1%); plan.json reports the gap actually reached.
    gap: float = 0.01
    # Bytes per device kept free below the budget for what the memory estimate misses: compile
    # with verify_memory sets it from XLA's compiled allocation of an earlier plan.
    memory_reserve: float = 0.0
    # Compile the plan's programs with XLA and plan again (with a reserve) while the compiled
    # allocation is over the budget (verify.py).
    verify_memory: bool = False
    # Also plan these views of the mesh (the same devices, an axis split in two; mesh.py's
    # mesh_views) and keep the fastest: "auto" (a one-axis mesh), "all", "off".
    mesh_views: str = "auto"
    # How the plan is kept among candidates: "estimate" (the cost model's fastest), or
    # "compiled": the model's plan and the canonical plans (canonical.py) are compiled by the
    # target compiler (libtpu for a TPU device model) and the lowest compiled score kept
    # (compiler.select_compiled).
    select: str = "estimate"

    @property
    def budget(self) -> float:
        """The user's budget (bytes per device): what plans are checked and reported against."""
        return float(self.memory_budget if self.memory_budget is not None else self.device.memory_bytes)

    @property
    def plan_budget(self) -> float:
        """The budget the planner's estimates must meet: the user's less the reserve."""
        return self.budget - self.memory_reserve


@dataclass
class PlanSpace:
    """The strategies of every planned op and how they map onto the problem's nodes."""

    strategies: dict[int, list[OpStrategy]] = field(default_factory=dict)  # op index -> strategies
    node_of: dict[int, int] = field(default_factory=dict)  # op index -> problem node index
    op_of: list[int] = field(default_factory=list)  # problem node index -> op index
    free_values: set[int] = field(default_factory=set)  # values any sharding of which is free
    fallbacks: dict[int, str] = field(default_factory=dict)  # op index -> why it is replicated
    # (matmul, operand position) -> (the earlier matmul whose resharded operand it reads, its
    # position): priced as a reshard from that layout, so emitted as one.
    reads_via: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    # A masked lookup whose partial rows libtpu reduce-scatters where its readers slice them:
    # gather op index -> ((reader op index, operand position) per read, its strategies as
    # enumerated, with the all-reduce's price) (build_sharding_problem._scatter_first_gathers).
    scatter_first: dict[int, tuple] = field(default_factory=dict)
    # An all-reduce a reader's layout may slice over the summed axes, which libtpu compiles as
    # a reduce-scatter: op index -> (reader op index, operand position) per read
    # (build_sharding_problem._sliced_all_reduces).
    sliced: dict[int, tuple] = field(default_factory=dict)


@dataclass
class CompileState:
    program: object  # ir.Program
    options: CompileOptions
    log: DiagnosticLog = field(default_factory=DiagnosticLog)
    graph: Graph | None = None
    handles: object | None = None  # ir.Handles
    comm: CommModel | None = None
    space: PlanSpace | None = None
    problem: ShardingProblem | None = None
    solution: Solution | None = None
    stats: SolveStats | None = None
    timings: dict[str, float] = field(default_factory=dict)
    facts: dict = field(default_factory=dict)  # small results passes report (counts, ...)

    @property
    def filename(self) -> str:
        return self.program.filename

    def chosen(self, op_index: int) -> OpStrategy:
        assert self.space is not None and self.solution is not None
        node = self.space.node_of[op_index]
        return self.space.strategies[op_index][self.solution.choice[node]]


class Pass(Protocol):
    name: str

    def apply(self, state: CompileState) -> None: ...
