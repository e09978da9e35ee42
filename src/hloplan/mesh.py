"""Logical device meshes: named axes with sizes.

A mesh is written either as sizes only, "8", "8x4", "16x8x8" (axes are then named x, y, z), or
with names, "data=8,model=4". Devices are numbered row-major over the mesh: the last axis varies
fastest, so on GPUs the last axis is the one that stays inside a node.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["MAX_AXES", "MeshError", "MeshSpec", "check_devices", "parse_mesh"]

MAX_AXES = 3
_DEFAULT_NAMES = ("x", "y", "z")


class MeshError(ValueError):
    """A mesh specification that cannot be used."""


def _validate(names: tuple[str, ...], sizes: tuple[int, ...], label: str) -> None:
    if len(names) != len(sizes):
        raise MeshError(f"mesh {label}: {len(names)} axis names but {len(sizes)} axis sizes")
    if not 1 <= len(sizes) <= MAX_AXES:
        raise MeshError(f"mesh {label}: expected 1 to {MAX_AXES} axes, got {len(sizes)}")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise MeshError(f"mesh {label}: axis sizes must be positive integers")
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise MeshError(f"mesh {label}: axis name {name!r} is not an identifier")
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise MeshError(f"mesh {label}: axis name {name!r} is used twice")
        seen.add(name)


@dataclass(frozen=True)
class MeshSpec:
    """A logical mesh: axis names and sizes, major (slowest-varying) axis first."""

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis_names", tuple(self.axis_names))
        object.__setattr__(self, "axis_sizes", tuple(self.axis_sizes))
        label = ",".join(f"{n}={s}" for n, s in zip(self.axis_names, self.axis_sizes, strict=False))
        _validate(self.axis_names, self.axis_sizes, repr(label))

    @property
    def size(self) -> int:
        """Number of devices the mesh needs."""
        return math.prod(self.axis_sizes)

    @property
    def ndim(self) -> int:
        return len(self.axis_sizes)

    @property
    def shape(self) -> dict[str, int]:
        """Axis name -> size, in mesh order (like `jax.sharding.Mesh.shape`)."""
        return dict(zip(self.axis_names, self.axis_sizes, strict=True))

    def axis_index(self, name: str) -> int:
        """Position of the axis called `name`; MeshError if there is none."""
        try:
            return self.axis_names.index(name)
        except ValueError:
            raise MeshError(
                f"mesh {self} has no axis {name!r} (axes: {', '.join(self.axis_names)})"
            ) from None

    def __str__(self) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(self.axis_names, self.axis_sizes, strict=True))


_SIZE_RE = re.compile(r"^\d+$")


def _parse_size(token: str, text: str) -> int:
    token = token.strip()
    if not _SIZE_RE.match(token) or int(token) <= 0:
        raise MeshError(f"mesh {text!r}: axis sizes must be positive integers")
    return int(token)


def parse_mesh(text: str) -> MeshSpec:
    """Parse "8", "8x4", "16x8x8" (axes named x, y, z) or "data=8,model=4" into a MeshSpec.

    Whitespace around tokens is ignored. Raises MeshError with a message naming the input for
    anything else: no axes, more than three, sizes that are not positive integers, names that are
    not identifiers or are repeated, or a mix of the two forms.
    """
    if not isinstance(text, str):
        raise MeshError(f"mesh {text!r}: expected a string such as '8x4' or 'data=8,model=4'")
    stripped = text.strip()
    if not stripped:
        raise MeshError(
            "mesh '': expected sizes such as '8x4' or named axes such as 'data=8,model=4'"
        )
    if "=" in stripped:
        names: list[str] = []
        sizes: list[int] = []
        for part in stripped.split(","):
            if part.count("=") != 1:
                raise MeshError(
                    f"mesh {text!r}: expected comma-separated name=size pairs, got {part.strip()!r}"
                )
            name, size = (p.strip() for p in part.split("="))
            if not name.isidentifier():
                raise MeshError(f"mesh {text!r}: axis name {name!r} is not an identifier")
            names.append(name)
            sizes.append(_parse_size(size, text))
    else:
        tokens = re.split(r"[xX]", stripped)
        sizes = [_parse_size(token, text) for token in tokens]
        if len(sizes) > MAX_AXES:
            raise MeshError(f"mesh {text!r}: expected 1 to {MAX_AXES} axes, got {len(sizes)}")
        names = list(_DEFAULT_NAMES[: len(sizes)])
    _validate(tuple(names), tuple(sizes), repr(text))
    return MeshSpec(tuple(names), tuple(sizes))


def check_devices(mesh: MeshSpec, available: int) -> None:
    """Raise MeshError if `mesh` needs more devices than `available`."""
    if mesh.size > available:
        raise MeshError(
            f"mesh {mesh} needs {mesh.size} devices but only {available} "
            f"{'is' if available == 1 else 'are'} available"
        )
