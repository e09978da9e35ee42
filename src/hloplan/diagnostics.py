"""Diagnostics in the mlir-opt style: `file:line:col: error: message` plus `note:` lines."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

# Exit codes shared by the CLI and the Python API.
EXIT_OK = 0
EXIT_DIAGNOSTICS = 1  # unsupported program, infeasible plan
EXIT_USAGE = 2  # usage, configuration or I/O error
EXIT_INTERNAL = 101


@dataclass(frozen=True)
class SourceLoc:
    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Diagnostic:
    severity: str  # "error" | "warning" | "note" | "remark"
    message: str
    location: SourceLoc | None = None
    notes: tuple[str, ...] = ()
    # The StableHLO op this is about, e.g. "stablehlo.custom_call @lapack_sgetrf".
    op: str | None = None

    def format(self, default_file: str = "<input>") -> str:
        """The mlir-opt form, with control characters from the input (an op's name, a file
        name) escaped so that printing it cannot drive the terminal."""
        where = _printable(str(self.location) if self.location else default_file)
        lines = [f"{where}: {self.severity}: {_printable(self.message)}"]
        if self.op:
            lines.append(f"{where}: note: in op '{_printable(self.op)}'")
        lines.extend(f"{where}: note: {_printable(note)}" for note in self.notes)
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "severity": self.severity,
            "message": self.message,
            "location": None
            if self.location is None
            else {"file": self.location.file, "line": self.location.line, "col": self.location.col},
            "op": self.op,
            "notes": list(self.notes),
        }


class HloplanError(Exception):
    """An error the user can act on; carries located diagnostics and an exit code."""

    def __init__(self, diagnostics: list[Diagnostic] | Diagnostic | str, exit_code: int = EXIT_DIAGNOSTICS):
        if isinstance(diagnostics, str):
            diagnostics = Diagnostic("error", diagnostics)
        if isinstance(diagnostics, Diagnostic):
            diagnostics = [diagnostics]
        self.diagnostics = list(diagnostics)
        self.exit_code = exit_code
        super().__init__("\n".join(d.format() for d in self.diagnostics))


class NoPlanFits(HloplanError):
    """No plan fits the memory budget. `min_peak`: the smallest peak per device any plan was
    found to need (bytes), when known; callers try other ways (recomputation, microbatches)."""

    def __init__(self, diagnostics, min_peak: float | None = None):
        super().__init__(diagnostics)
        self.min_peak = min_peak


class UsageError(HloplanError):
    def __init__(self, message: str, notes: tuple[str, ...] = ()):
        super().__init__(Diagnostic("error", message, notes=notes), exit_code=EXIT_USAGE)


@dataclass
class DiagnosticLog:
    """Warnings and remarks gathered while compiling; errors are raised as HloplanError."""

    entries: list[Diagnostic] = field(default_factory=list)

    def warn(self, message: str, location: SourceLoc | None = None, op: str | None = None,
             notes: tuple[str, ...] = ()) -> None:
        self.entries.append(Diagnostic("warning", message, location, notes, op))

    def remark(self, message: str, location: SourceLoc | None = None, op: str | None = None) -> None:
        self.entries.append(Diagnostic("remark", message, location, (), op))

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.entries if d.severity == "warning"]

    def to_json(self) -> str:
        return json.dumps([d.to_json() for d in self.entries], indent=2)


# C0 and C1 control characters, DEL, and the Unicode line separators and bidirectional
# overrides: in a string from a file (plan.json, an op's name) they could move the cursor, recolour
# or rewrite what a terminal shows.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def escape_control(text: str) -> str:
    """`text` with control characters written as escapes (ESC -> \\x1b), safe to print."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                        else f"\\u{ord(m.group()):04x}", text)


def escape_strings(value):
    """A copy of a JSON value (plan.json) with every string, keys included, escaped."""
    if isinstance(value, str):
        return escape_control(value)
    if isinstance(value, dict):
        return {escape_strings(k): escape_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [escape_strings(v) for v in value]
    return value


def _printable(text: str) -> str:
    """escape_control, keeping the line breaks and tabs of multi-line messages."""
    return "\n".join("\t".join(escape_control(part) for part in line.split("\t"))
                     for line in text.split("\n"))
