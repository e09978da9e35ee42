"""How fast this machine is right now: timings of different days compare only beside it.

`machine_speed()` times two fixed single-threaded workloads, best of three each:
`python_s`, integer arithmetic and dict traffic; `memory_s`, building a million small objects
and touching 256 MiB of fresh pages, the allocation the planner does on a big module. The
shared 2-core machines of this project have run the same compile at half the speed on one day
as on the day before, MLIR's C++ parser included (0.09 s -> 0.21 s), while a pure-Python loop
ran as fast as ever: the benchmarks record both numbers beside their timings.
"""

from __future__ import annotations

import time


def _python_work() -> int:
    table: dict[int, int] = {}
    total = 0
    for i in range(2_000_000):
        total += i * 7 % 13
        table[i & 4095] = total
    return total + len(table)


def _memory_work() -> int:
    objects = [{"index": i, "parts": [i, i + 1, i + 2]} for i in range(1_000_000)]
    pages = bytearray(256 * 1024 * 1024)
    pages[::4096] = b"x" * (len(pages) // 4096)
    return len(objects) + len(pages)


def _best(work, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return round(best, 3)


def machine_speed(repeats: int = 3) -> dict[str, float]:
    return {"python_s": _best(_python_work, repeats), "memory_s": _best(_memory_work, repeats)}


if __name__ == "__main__":
    print(machine_speed())
