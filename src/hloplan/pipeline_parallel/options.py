"""What the user asks of pipeline parallelism (--stages, --microbatches, --schedule, ...)."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b")
MAX_AUTO_STAGES = 8
DEFAULT_LAYERS = 8
DEFAULT_MAX_SOLVES = 48
DEFAULT_GAP = 0.01


@dataclass(frozen=True)
class PipelineOptions:
    stages: int | None = None  # None: auto
    microbatches: int | None = None  # None: auto
    schedule: str = "1f1b"
    batch_args: tuple[str, ...] = ()
    layers: int | None = None  # candidate layers for the stage DP (None: DEFAULT_LAYERS)
    max_solves: int = DEFAULT_MAX_SOLVES  # ILP solves the stage search may spend
    gap: float = DEFAULT_GAP  # stop when no lower bound beats the best plan by more than this
    # Gradient accumulation where no single-program plan fits: one stage, any number of
    # microbatches M >= 2 dividing the batch, the fastest that fits (nothing if none does).
    accumulate: bool = False
