"""How fast this machine is right now, as one number: timings of different days compare only
after dividing by it.

`machine_seconds()` is the best of three runs of a fixed single-threaded Python workload
(integer arithmetic and dict and list traffic, like the planner's passes). The shared 2-core
machines of this project have run the same compile at half the speed on one day as on the day
before; the benchmarks record this number beside their timings.
"""

from __future__ import annotations

import time


def _workload() -> int:
    table: dict[int, int] = {}
    total = 0
    for i in range(2_000_000):
        total += i * 7 % 13
        table[i & 4095] = total
    values = sorted(table.values())
    return total + values[len(values) // 2]


def machine_seconds(repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        _workload()
        best = min(best, time.perf_counter() - started)
    return round(best, 3)


if __name__ == "__main__":
    print(machine_seconds())
