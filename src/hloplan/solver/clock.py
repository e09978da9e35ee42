"""Which solves the clock cut short.

Every limit the search sets itself is a count of work (rounds, windows, nodes), so a plan
depends on the machine's speed only where the time limit stopped some solve. A compile makes
many solves (the memory re-solves of solve-sharding, tying's comparison, pipeline stages,
recomputed and canonical plans, mesh views) and an early one the clock cut can shape the final
plan even when the last solve is not cut. Solvers report each cut with `cut`; whoever needs to
know whether anything it ran was cut wraps the work in `watch`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_watchers: list[list[str]] = []


@contextmanager
def watch() -> Iterator[list[str]]:
    """A list that receives what each solve cut by the clock within the block says; nested
    blocks each receive every cut."""
    cuts: list[str] = []
    _watchers.append(cuts)
    try:
        yield cuts
    finally:
        # By identity: two watchers that saw the same cuts are equal lists.
        del _watchers[next(i for i, w in enumerate(_watchers) if w is cuts)]


def cut(what: str) -> None:
    """Report a solve the time limit stopped (or whose run reached its time limit)."""
    for cuts in _watchers:
        cuts.append(what)
