"""XLA's TPU compiler (libtpu) in the loop, on a machine without a TPU.

With libtpu installed (`pip install "hloplan[tpu]"`), jax describes a TPU slice it cannot run
on: `jax.experimental.topologies.get_topology_desc("v5e:2x4", platform="tpu")` gives
compile-only devices, and a plan's loader compiles for them with the real TPU compiler (as
MaxText's train_compile.py checks memory ahead of time). `hloplan verify` and `hloplan compile
--verify-memory` do this in a child process (verify.py) for plans made for a TPU device model.

Topologies: a device model names its kind (`tpu_topology` in its TOML: v5e, v6e, v5p, v4); the
topology is chosen by the mesh's device count (`topology_for`), or given by name (`--topology
v5e:4x8`). v5e and v6e slices are 2D (1x1 to 16x16 chips), v5p and v4 3D. libtpu's deviceless
v4 topologies have two devices per chip (one per TensorCore); the others one per chip.

The runtime stays on CPU in that process (JAX_PLATFORMS=cpu) and TPU_SKIP_MDS_QUERY=1 keeps
libtpu from asking a cloud metadata server what machine it is on.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from dataclasses import dataclass

from hloplan.diagnostics import UsageError

__all__ = ["KINDS", "TopologyKind", "child_env", "libtpu_available", "parse_topology",
           "topology_devices", "topology_for"]


@dataclass(frozen=True)
class TopologyKind:
    name: str
    dims: int  # 2: a 2D torus (AxB chips); 3: a 3D torus (AxBxC chips)
    max_chips: int  # the largest slice hloplan will name for it
    devices_per_chip: int = 1


KINDS: dict[str, TopologyKind] = {
    "v5e": TopologyKind("v5e", 2, 256),
    "v6e": TopologyKind("v6e", 2, 256),
    "v5p": TopologyKind("v5p", 3, 4096),
    "v4": TopologyKind("v4", 3, 4096, devices_per_chip=2),
}

# libtpu's default host is 2x2x1 chips: smaller slices need chips_per_host_bounds given.
_HOST = (2, 2, 1)
_NAME_RE = re.compile(r"^(v\d+[a-z]*):(\d+(?:x\d+){1,2})$")


def libtpu_available() -> bool:
    """Whether the TPU compiler can be loaded (the `libtpu` package is installed)."""
    return importlib.util.find_spec("libtpu") is not None


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a process compiling for a TPU topology without a TPU needs."""
    env = dict(os.environ if env is None else env)
    env["JAX_PLATFORMS"] = "cpu"
    env["TPU_SKIP_MDS_QUERY"] = "1"
    # A parent that loaded libtpu (jax without JAX_PLATFORMS=cpu does) holds its lockfile.
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _shape(chips: int, dims: int) -> tuple[int, ...] | None:
    """libtpu's slice of `chips` chips (a power of two): 2D 1x1, 1x2, 2x2, 2x4, 4x4, ...; 3D
    1x1x1, 1x2x1, 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ... (each step doubles the smallest
    dimension, the last among equals; a 3D slice fills its first two dimensions first)."""
    if chips < 1 or chips & (chips - 1):
        return None
    shape = [1] * dims
    for step in range(chips.bit_length() - 1):
        if dims == 3 and step < 2:
            i = 1 - step
        else:
            i = max(range(dims), key=lambda d: (-shape[d], d))
        shape[i] *= 2
    return tuple(shape)


@dataclass(frozen=True)
class Topology:
    name: str  # "v5e:2x4"
    kind: TopologyKind
    shape: tuple[int, ...]

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def devices(self) -> int:
        return self.chips * self.kind.devices_per_chip

    @property
    def host_bounds(self) -> list[int] | None:
        """chips_per_host_bounds for slices smaller than libtpu's default host."""
        full = list(self.shape) + [1] * (3 - len(self.shape))
        if all(s % h == 0 for s, h in zip(full, _HOST)):
            return None
        return full


def parse_topology(name: str) -> Topology:
    """A topology name such as "v5e:2x4" or "v5p:2x2x4", checked."""
    m = _NAME_RE.match(name.strip().lower())
    if m is None or m.group(1) not in KINDS:
        raise UsageError(f"unknown TPU topology {name!r}: expected KIND:AxB (v5e, v6e) or "
                         f"KIND:AxBxC (v5p, v4), e.g. v5e:2x4 or v5p:2x2x2")
    kind = KINDS[m.group(1)]
    shape = tuple(int(s) for s in m.group(2).split("x"))
    if len(shape) != kind.dims or min(shape) < 1:
        raise UsageError(f"TPU topology {name!r}: {kind.name} slices have {kind.dims} "
                         f"dimensions")
    return Topology(f"{kind.name}:{m.group(2)}", kind, shape)


def topology_for(kind_name: str, devices: int) -> Topology:
    """The slice of `kind_name` TPUs with `devices` devices; a UsageError naming the sizes there
    are when no slice has that many."""
    kind = KINDS.get(kind_name)
    if kind is None:
        raise UsageError(f"unknown TPU kind {kind_name!r} (known: {', '.join(KINDS)})")
    chips, rest = divmod(devices, kind.devices_per_chip)
    shape = _shape(chips, kind.dims) if not rest else None
    if shape is None or chips > kind.max_chips:
        sizes = [2 ** k * kind.devices_per_chip
                 for k in range(int(math.log2(kind.max_chips)) + 1)]
        raise UsageError(
            f"no TPU {kind.name} topology has {devices} devices: {kind.name} slices have "
            f"{', '.join(map(str, sizes))} devices; plan for one of those mesh sizes, or name a "
            f"topology with --topology")
    return Topology(f"{kind.name}:{'x'.join(map(str, shape))}", kind, shape)


def topology_devices(topology: Topology) -> list:
    """The compile-only devices of `topology` (in this process: set child_env() before jax
    initialises its backends)."""
    from jax.experimental import topologies

    kwargs = {}
    if topology.host_bounds is not None:
        kwargs["chips_per_host_bounds"] = topology.host_bounds
    desc = topologies.get_topology_desc(topology_name=topology.name, platform="tpu", **kwargs)
    return list(desc.devices)


def platforms_note(platforms: tuple[str, ...]) -> str | None:
    """Why a plan whose program was exported for `platforms` is compiled for tpu anyway (None
    when it lists tpu)."""
    if "tpu" in platforms:
        return None
    return (f"the program was exported for {', '.join(platforms)} only: compiled for tpu as "
            f"if exported for it (export with jax.export.export(f, platforms=['tpu']) or "
            f"['cpu', 'tpu'] for TPU lowering rules)")


def retarget_exported(data: bytes) -> tuple[bytes, str | None]:
    """A serialized Exported made compilable for tpu: one exported for a single other platform
    is relabelled tpu (its module takes no platform index; its lowering stays the other
    platform's). Returns (bytes, note or None)."""
    import dataclasses

    from jax import export

    exported = export.deserialize(bytearray(data))
    note = platforms_note(tuple(exported.platforms))
    if note is None:
        return data, None
    if len(exported.platforms) != 1:
        raise UsageError(f"the program was exported for {', '.join(exported.platforms)}: "
                         "export it with platforms=['tpu'] (or a list with 'tpu') to compile "
                         "it for a TPU topology")
    return bytes(dataclasses.replace(exported, platforms=("tpu",)).serialize()), note
