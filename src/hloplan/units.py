"""Parsing and formatting of byte sizes and durations.

`parse_bytes` reads sizes as users and TOML files write them ("16GiB", "1.5 GB", "4096");
`format_bytes` and `format_seconds` print them back with three significant digits.
"""

from __future__ import annotations

import math
import re

__all__ = ["format_bytes", "format_seconds", "parse_bytes", "stages_text"]

_BYTE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "pb": 1000**5,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
}

_SIZE_RE = re.compile(
    r"^\s*(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(?P<unit>[A-Za-z]*)\s*$"
)


def parse_bytes(text: str | int) -> int:
    """Return the number of bytes that `text` names.

    Accepts a plain number of bytes ("4096", 4096) or a number followed by a unit: B; KB, MB, GB,
    TB, PB (powers of 1000); KiB, MiB, GiB, TiB, PiB (powers of 1024). Units are case-insensitive
    and may be separated from the number by whitespace; fractions are allowed ("1.5GiB") and the
    result is rounded to a whole number of bytes. Raises ValueError on anything else.
    """
    if isinstance(text, bool):
        raise ValueError(f"invalid byte size {text!r}: expected a number or a string like '16GiB'")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"invalid byte size {text!r}: must not be negative")
        return text
    if isinstance(text, float):
        if not math.isfinite(text) or text < 0:
            raise ValueError(f"invalid byte size {text!r}: must be a finite, non-negative number")
        return round(text)
    if not isinstance(text, str):
        raise ValueError(f"invalid byte size {text!r}: expected a number or a string like '16GiB'")
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(
            f"invalid byte size {text!r}: expected a non-negative number with an optional unit, "
            "e.g. '4096', '512MB', '16GiB'"
        )
    unit = match.group("unit").lower()
    if unit not in _BYTE_UNITS:
        raise ValueError(
            f"invalid byte size {text!r}: unknown unit {match.group('unit')!r} "
            "(known: B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB)"
        )
    value = float(match.group("num")) * _BYTE_UNITS[unit]
    if not math.isfinite(value):
        raise ValueError(f"invalid byte size {text!r}: too large")
    return round(value)


def _three_digits(value: float) -> str:
    """`value` (expected in [0, 1000) after rounding, or larger) with 3 significant digits."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def format_bytes(n: float) -> str:
    """Format a byte count with binary units: 512 -> '512 B', 1610612736 -> '1.50 GiB'."""
    if isinstance(n, float) and not math.isfinite(n):
        return f"{n} B"
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1024:
        return f"{sign}{n:.0f} B" if n == int(n) else f"{sign}{_three_digits(n)} B"
    for unit, scale in (("PiB", 1024**5), ("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2)):
        if n >= scale:
            return f"{sign}{_three_digits(n / scale)} {unit}"
    return f"{sign}{_three_digits(n / 1024)} KiB"


_TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))


def format_seconds(s: float) -> str:
    """Format a duration with 3 significant digits: 0.00123 -> '1.23 ms', 2.5e-8 -> '25.0 ns'."""
    if not math.isfinite(s):
        return f"{s} s"
    if s == 0:
        return "0 s"
    sign = "-" if s < 0 else ""
    s = abs(s)
    if s >= 1e5 or s < 1e-12:  # absurd device models: keep the text short
        return f"{sign}{s:.3g} s"
    for unit, scale in _TIME_UNITS:
        # Round first so that 0.9996 s prints as '1.00 s', not '1000 ms'.
        rounded = float(f"{s / scale:.3g}")
        if rounded >= 1:
            return f"{sign}{_three_digits(rounded)} {unit}"
    return f"{sign}{s / 1e-9:.3g} ns"


def stages_text(stages: int, microbatches: int) -> str:
    """'1 stage x 4 microbatches', '2 stages x 8 microbatches'."""
    return f"{stages} stage{'' if stages == 1 else 's'} x {microbatches} microbatches"
