"""Logical device meshes: named axes with sizes.

A mesh is written either as sizes only, "8", "8x4", "16x8x8" (axes are then named x, y, z), or
with names, "data=8,model=4". Devices are numbered row-major over the mesh: the last axis varies
fastest, so on GPUs the last axis is the one that stays inside a node.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["MAX_AXES", "MESH_VIEW_CHOICES", "MeshError", "MeshSpec", "check_devices", "idle_axes",
           "mesh_views", "parse_mesh"]

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
        if not _is_axis_name(name):
            raise MeshError(f"mesh {label}: axis name {name!r} is not an identifier (ASCII)")
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise MeshError(f"mesh {label}: axis name {name!r} is used twice")
        seen.add(name)


def _is_axis_name(name) -> bool:
    # ASCII only: XLA aborts the process on other axis names when the plan runs.
    return isinstance(name, str) and name.isascii() and name.isidentifier()


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
            if not _is_axis_name(name):
                raise MeshError(f"mesh {text!r}: axis name {name!r} is not an identifier "
                                "(ASCII letters, digits and '_', not starting with a digit)")
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


# Which views of the given mesh hloplan also plans (CompileOptions.mesh_views): "auto" splits a
# one-axis mesh in two, "all" splits any axis of a mesh with fewer than MAX_AXES axes, "off"
# plans the mesh as given.
MESH_VIEW_CHOICES = ("auto", "all", "off")


def _split_names(names: tuple[str, ...], index: int) -> tuple[str, str]:
    """Names for the two parts of axis `index`: its name with 0 (major part) and 1, with
    underscores added until neither is another axis's name."""
    base = names[index]
    others = set(names) - {base}
    while f"{base}0" in others or f"{base}1" in others:
        base += "_"
    return f"{base}0", f"{base}1"


def mesh_views(mesh: MeshSpec, how: str = "auto") -> list[MeshSpec]:
    """`mesh` first, then the other logical meshes over the same devices in the same order that
    `how` asks for (MESH_VIEW_CHOICES): one axis of size a*b split into a major part of size a
    and a minor part of size b (a, b >= 2). Devices are numbered row-major, so the split keeps
    every device's position: device d is at the same place in both meshes, and each part runs
    over the links the whole axis ran over or faster ones (hardware.axis_links).

    A one-axis mesh such as "8" is often just a device count: planned as 2x4 and 4x2 too, it
    can combine two kinds of parallelism (tensor parallel over 2 devices, data parallel over 4),
    as a mesh of named axes written by hand would."""
    if how not in MESH_VIEW_CHOICES:
        raise MeshError(f"unknown mesh view choice {how!r} ({', '.join(MESH_VIEW_CHOICES)})")
    views = [mesh]
    if how == "off" or mesh.ndim >= MAX_AXES or (how == "auto" and mesh.ndim > 1):
        return views
    for index, size in enumerate(mesh.axis_sizes):
        major_names = _split_names(mesh.axis_names, index)
        for major in range(2, size // 2 + 1):
            if size % major:
                continue
            names = mesh.axis_names[:index] + major_names + mesh.axis_names[index + 1:]
            sizes = mesh.axis_sizes[:index] + (major, size // major) + mesh.axis_sizes[index + 1:]
            views.append(MeshSpec(names, sizes))
    return views


def idle_axes(mesh: MeshSpec, shapes) -> list[str]:
    """Axes of `mesh` (size > 1) that divide no dimension of any of `shapes`: no tensor can be
    split over them, alone or with other axes, so the plan replicates over them."""
    sizes = {size for shape in shapes for size in shape}
    return [name for name, size in zip(mesh.axis_names, mesh.axis_sizes, strict=True)
            if size > 1 and not any(dim % size == 0 for dim in sizes)]
