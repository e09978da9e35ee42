"""compiler.choose, the one rule by which the driver keeps a plan among candidates."""

from __future__ import annotations

from hloplan.compiler import Candidate, Estimate, choose


def _candidate(way: str, step: float, forced: bool = False) -> Candidate:
    # choose reads only the estimate and whether the user forced the plan.
    return Candidate(way, state=None, estimate=Estimate(step, 0.0), why=way, forced=forced)


def test_the_fastest_estimate_is_kept_and_the_first_of_equals():
    single, pipelined, other = _candidate("single", 2.0), _candidate("pipelined", 1.0), \
        _candidate("accumulated", 1.0)
    assert choose([single, pipelined, other]) is pipelined
    assert choose([single]) is single


def test_a_plan_the_user_forced_is_kept_even_when_slower():
    single, forced = _candidate("single", 1.0), _candidate("pipelined", 3.0, forced=True)
    assert choose([single, forced]) is forced
    faster_forced = _candidate("pipelined", 2.0, forced=True)
    assert choose([single, forced, faster_forced]) is faster_forced
