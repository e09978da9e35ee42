"""Fuzzing hostile inputs: mutated programs (StableHLO text, portable-artifact bytecode,
serialized Exported) and corrupted plan directories.

What must hold for every example: compiling gives a plan or an HloplanError carrying located
diagnostics and exit code 1 or 2 (the CLI's internal error, exit 101, never); loading a plan
directory gives a runner or PlanLoadError; `hloplan explain` exits 0 or 2 without a traceback.

CI runs a few dozen examples per property. HLOPLAN_FUZZ_EXAMPLES=N (or --runslow, which runs the
`slow` variants at 20x) runs more; HLOPLAN_FUZZ_REPORT=FILE appends the counts tried and held
(docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hloplan.cli import main
from hloplan.compiler import compile_bytes, make_options
from hloplan.diagnostics import EXIT_DIAGNOSTICS, EXIT_USAGE, HloplanError
from hloplan.emit.loader import PlanLoadError, Runner, read_plan

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
SEEDS = {
    "mlir": (FIXTURES / "mlp_forward.mlir").read_bytes(),
    "exported": (FIXTURES / "mlp_forward.jaxexport").read_bytes(),
    "bytecode": (FIXTURES / "mlp_train_step.vhlo").read_bytes(),
}
EXAMPLES = int(os.environ.get("HLOPLAN_FUZZ_EXAMPLES", "0")) or 30
COUNTS: Counter = Counter()


def _settings(examples: int):
    return settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    target = os.environ.get("HLOPLAN_FUZZ_REPORT")
    if target:
        with open(target, "a") as out:
            out.write(json.dumps(dict(sorted(COUNTS.items()))) + "\n")


# --------------------------------------------------------------------------- mutations


@st.composite
def mutated(draw, data: bytes) -> bytes:
    """`data` with a few byte-level edits: flips, truncation, deleted, duplicated or inserted
    runs."""
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "truncate", "delete", "duplicate", "insert"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            for i in range(at, min(at + draw(st.integers(1, 64)), len(data))):
                data[i] ^= draw(st.integers(1, 255))
        elif kind == "truncate":
            del data[at:]
        elif kind == "delete":
            del data[at:at + draw(st.integers(1, 256))]
        elif kind == "duplicate":
            data[at:at] = data[at:at + draw(st.integers(1, 256))]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=32))
    return bytes(data)


def _compile_holds(kind: str, data: bytes) -> None:
    COUNTS[f"compile.{kind}.tried"] += 1
    if os.environ.get("HLOPLAN_FUZZ_LAST"):  # what to replay if the process dies
        Path(os.environ["HLOPLAN_FUZZ_LAST"]).write_bytes(data)
    options = make_options("2", device="toy", time_limit=5.0, mesh_views="off")
    try:
        compile_bytes(data, f"fuzz.{kind}", options)
        COUNTS[f"compile.{kind}.planned"] += 1
    except HloplanError as exc:
        assert exc.exit_code in (EXIT_DIAGNOSTICS, EXIT_USAGE)
        errors = [d for d in exc.diagnostics if d.severity == "error"]
        assert errors, exc.diagnostics
        assert all(d.location is not None and d.location.line > 0 for d in errors[:1]), errors
        COUNTS[f"compile.{kind}.refused"] += 1
        if "reader crashed" in errors[0].message:  # caught by the forked child
            COUNTS[f"compile.{kind}.reader_crashed"] += 1
    COUNTS[f"compile.{kind}.held"] += 1


def _given_compile(kind: str):
    @given(mutated(SEEDS[kind]))
    def check(data):
        _compile_holds(kind, data)
    return check


@pytest.mark.parametrize("kind", sorted(SEEDS))
def test_mutated_programs_never_crash(kind):
    _settings(EXAMPLES)(_given_compile(kind))()


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(SEEDS))
def test_mutated_programs_never_crash_long(kind):
    _settings(EXAMPLES * 20)(_given_compile(kind))()


# --------------------------------------------------------------------------- plan directories


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz") / "plan"
    result = CliRunner().invoke(main, ["compile", str(FIXTURES / "mlp_forward.mlir"), "--mesh",
                                       "2", "--device", "toy", "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 1 << 40) | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, (*prefix, i))


@st.composite
def corruption(draw, plan: dict, files: list[str]):
    """(file, new bytes or None to delete) edits of a plan directory."""
    kind = draw(st.sampled_from(["field", "field", "field", "drop", "plan-bytes", "artifact"]))
    if kind in ("field", "drop"):
        paths = [p for p in _paths(plan) if p]
        path = draw(st.sampled_from(paths))
        edited = json.loads(json.dumps(plan))
        node = edited
        for part in path[:-1]:
            node = node[part]
        if kind == "drop":
            del node[path[-1]]
        else:
            node[path[-1]] = draw(json_values)
        return kind, "plan.json", json.dumps(edited).encode()
    if kind == "plan-bytes":
        return kind, "plan.json", draw(mutated(json.dumps(plan).encode()))
    name = draw(st.sampled_from(files))
    return kind, name, draw(st.none() | st.just(b"") | st.binary(max_size=64))


def _plan_holds(plan_dir: Path, work: Path, edit, run_plans: bool = False) -> None:
    kind, name, data = edit
    COUNTS[f"plan.{kind}.tried"] += 1
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(plan_dir, work)
    if data is None:
        (work / name).unlink()
    else:
        (work / name).write_bytes(data)
    try:
        Runner(work)
        COUNTS[f"plan.{kind}.loaded"] += 1
        loaded = True
    except PlanLoadError as exc:
        assert exc.file, exc
        COUNTS[f"plan.{kind}.refused"] += 1
        loaded = False
    if run_plans and loaded:  # the artifacts match their digests: it runs, and matches
        result = CliRunner().invoke(main, ["run", str(work), "--check"])
        assert result.exit_code in (0, 2), (result.output, result.exception)
        assert result.exception is None or isinstance(result.exception, SystemExit)
        COUNTS[f"plan.{kind}.ran.exit{result.exit_code}"] += 1
    result = CliRunner().invoke(main, ["explain", str(work)])
    assert result.exit_code in (0, 2), (result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    COUNTS[f"plan.{kind}.held"] += 1


def _given_plan(plan_dir: Path, work: Path, run_plans: bool = False):
    plan = read_plan(plan_dir)
    files = sorted(plan["digests"])

    @given(corruption(plan, files))
    def check(edit):
        _plan_holds(plan_dir, work, edit, run_plans)
    return check


def test_corrupted_plan_directories_are_refused(plan_dir, tmp_path):
    _settings(EXAMPLES * 2)(_given_plan(plan_dir, tmp_path / "work"))()


@pytest.mark.slow
def test_corrupted_plan_directories_are_refused_long(plan_dir, tmp_path):
    _settings(EXAMPLES * 40)(_given_plan(plan_dir, tmp_path / "work"))()


def test_corrupted_plans_that_load_run(plan_dir, tmp_path):
    """`run --check` on plans whose plan.json was edited but still loads: exit 0 or 2."""
    _settings(max(EXAMPLES // 5, 1))(_given_plan(plan_dir, tmp_path / "work", True))()


@pytest.mark.slow
def test_corrupted_plans_that_load_run_long(plan_dir, tmp_path):
    _settings(EXAMPLES * 5)(_given_plan(plan_dir, tmp_path / "work", True))()
