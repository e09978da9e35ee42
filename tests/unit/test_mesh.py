"""Mesh specs and byte/duration units."""

from __future__ import annotations

import pytest

from hloplan.mesh import MeshError, MeshSpec, check_devices, parse_mesh
from hloplan.units import format_bytes, format_seconds, parse_bytes

# --- parse_mesh ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "names", "sizes"),
    [
        ("8", ("x",), (8,)),
        ("8x4", ("x", "y"), (8, 4)),
        ("16x8x8", ("x", "y", "z"), (16, 8, 8)),
        (" 2 x 4 ", ("x", "y"), (2, 4)),
        ("2X4", ("x", "y"), (2, 4)),
        ("data=8,model=4", ("data", "model"), (8, 4)),
        ("data = 8 , model = 4", ("data", "model"), (8, 4)),
        ("batch=2", ("batch",), (2,)),
        ("a=1,b=2,c_3=3", ("a", "b", "c_3"), (1, 2, 3)),
    ],
)
def test_parse_mesh_good(text: str, names: tuple[str, ...], sizes: tuple[int, ...]) -> None:
    mesh = parse_mesh(text)
    assert mesh == MeshSpec(names, sizes)
    assert mesh.axis_names == names and mesh.axis_sizes == sizes


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("8x0", "mesh '8x0': axis sizes must be positive integers"),
        ("", "mesh ''"),
        ("   ", "mesh ''"),
        ("8x", "axis sizes must be positive integers"),
        ("x8", "axis sizes must be positive integers"),
        ("-2x4", "axis sizes must be positive integers"),
        ("2.5x4", "axis sizes must be positive integers"),
        ("8*4", "axis sizes must be positive integers"),
        ("2x2x2x2", "expected 1 to 3 axes, got 4"),
        ("a=1,b=1,c=1,d=1", "expected 1 to 3 axes, got 4"),
        ("data=8,data=4", "axis name 'data' is used twice"),
        ("1data=8", "axis name '1data' is not an identifier"),
        ("=8", "axis name '' is not an identifier"),
        ("data=0", "axis sizes must be positive integers"),
        ("data=two", "axis sizes must be positive integers"),
        ("data=8,4", "expected comma-separated name=size pairs, got '4'"),
        ("data=8,,model=4", "expected comma-separated name=size pairs"),
        ("data==8", "expected comma-separated name=size pairs"),
    ],
)
def test_parse_mesh_bad(text: str, message: str) -> None:
    with pytest.raises(MeshError) as info:
        parse_mesh(text)
    assert message in str(info.value)


def test_mesh_error_is_value_error() -> None:
    assert issubclass(MeshError, ValueError)


def test_mesh_spec_properties() -> None:
    mesh = parse_mesh("data=2,model=4")
    assert mesh.size == 8
    assert mesh.ndim == 2
    assert mesh.shape == {"data": 2, "model": 4}
    assert list(mesh.shape) == ["data", "model"]
    assert mesh.axis_index("model") == 1
    assert str(mesh) == "data=2,model=4"
    assert str(parse_mesh("16x8x8")) == "x=16,y=8,z=8"
    assert parse_mesh(str(mesh)) == mesh
    with pytest.raises(MeshError, match="has no axis 'pipe'.*data, model"):
        mesh.axis_index("pipe")


def test_mesh_spec_is_frozen_and_hashable() -> None:
    mesh = parse_mesh("4x2")
    assert hash(mesh) == hash(MeshSpec(("x", "y"), (4, 2)))
    with pytest.raises(AttributeError):
        mesh.axis_sizes = (8,)  # type: ignore[misc]


def test_mesh_spec_constructor_validates() -> None:
    assert MeshSpec(["a"], [3]).axis_names == ("a",)  # lists become tuples
    with pytest.raises(MeshError, match="1 axis names but 2 axis sizes"):
        MeshSpec(("a",), (2, 2))
    with pytest.raises(MeshError, match="positive integers"):
        MeshSpec(("a",), (0,))
    with pytest.raises(MeshError, match="used twice"):
        MeshSpec(("a", "a"), (2, 2))
    with pytest.raises(MeshError, match="expected 1 to 3 axes, got 0"):
        MeshSpec((), ())


def test_check_devices() -> None:
    check_devices(parse_mesh("2x4"), 8)
    check_devices(parse_mesh("2x2"), 8)  # using fewer devices than available is fine
    with pytest.raises(MeshError) as info:
        check_devices(parse_mesh("data=8,model=4"), 8)
    assert "32" in str(info.value) and "8" in str(info.value)
    assert str(info.value) == "mesh data=8,model=4 needs 32 devices but only 8 are available"
    with pytest.raises(MeshError, match="needs 2 devices but only 1 is available"):
        check_devices(parse_mesh("2"), 1)


# --- units -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GiB", 16 * 1024**3),
        ("16 gib", 16 * 1024**3),
        (" 80GiB ", 80 * 1024**3),
        ("1.5GiB", 1610612736),
        ("4096", 4096),
        ("4096B", 4096),
        ("0", 0),
        ("1KB", 1000),
        ("1kb", 1000),
        ("2MB", 2_000_000),
        ("3GB", 3_000_000_000),
        ("1TB", 10**12),
        ("1KiB", 1024),
        ("1MiB", 1048576),
        ("1TiB", 1024**4),
        (".5KiB", 512),
        ("1e3", 1000),
        (4096, 4096),
    ],
)
def test_parse_bytes_good(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected
    assert isinstance(parse_bytes(text), int)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected a non-negative number"),
        ("GiB", "expected a non-negative number"),
        ("-1GiB", "expected a non-negative number"),
        ("16 G", "unknown unit 'G'"),
        ("16 gigabytes", "unknown unit 'gigabytes'"),
        ("16GiB extra", "expected a non-negative number"),
        ("1,000", "expected a non-negative number"),
        (-5, "must not be negative"),
        (True, "expected a number"),
    ],
)
def test_parse_bytes_bad(text: object, message: str) -> None:
    with pytest.raises(ValueError, match="invalid byte size") as info:
        parse_bytes(text)  # type: ignore[arg-type]
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (1048576, "1.00 MiB"),
        (10 * 1048576, "10.0 MiB"),
        (1610612736, "1.50 GiB"),
        (80 * 1024**3, "80.0 GiB"),
        (123 * 1024**4, "123 TiB"),
        (-2048, "-2.00 KiB"),
    ],
)
def test_format_bytes(n: int, expected: str) -> None:
    assert format_bytes(n) == expected


@pytest.mark.parametrize(
    ("s", "expected"),
    [
        (0, "0 s"),
        (1.0, "1.00 s"),
        (12.345, "12.3 s"),
        (0.00123, "1.23 ms"),
        (0.0123, "12.3 ms"),
        (0.123, "123 ms"),
        (4.5e-5, "45.0 us"),
        (2.5e-8, "25.0 ns"),
        (1e-9, "1.00 ns"),
        (0.9996, "1.00 s"),  # rounds up into the next unit
        (-0.002, "-2.00 ms"),
        (2.34e305, "2.34e+305 s"),  # a device model of absurd speed: short text
    ],
)
def test_format_seconds(s: float, expected: str) -> None:
    assert format_seconds(s) == expected
