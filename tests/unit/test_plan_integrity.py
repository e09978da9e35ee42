"""Plan directories are checked before anything runs: every malformed one gives exit 2 from
`run` and `explain` and PlanLoadError (with the file and the field) from `hloplan.load`;
plan.json's digests catch changed, truncated and swapped artifacts; file names stay inside the
plan directory; a trusted loader never runs another plan's code; explain escapes control
characters; plans are replaced all or nothing."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import hloplan
from hloplan.cli import main
from hloplan.emit import artifact
from hloplan.emit.loader import PlanLoadError, read_plan

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
PROGRAM = FIXTURES / "mlp_forward.mlir"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Two plans of different programs: (mlp plan dir, gpt-shaped other plan dir)."""
    root = tmp_path_factory.mktemp("plans")
    first, other = root / "mlp", root / "other"
    assert run("compile", PROGRAM, "--mesh", "2", "--device", "toy", "-o", first).exit_code == 0
    result = run("compile", FIXTURES / "misc_ops.mlir", "--mesh", "2", "--device", "toy", "-o",
                 other)
    assert result.exit_code == 0, result.output
    return first, other


def _plan(path: Path) -> dict:
    return json.loads((path / "plan.json").read_text())


def _write_plan(path: Path, plan) -> None:
    (path / "plan.json").write_text(json.dumps(plan))


def _edit(key):
    def edit(plan_dir, other):
        plan = _plan(plan_dir)
        key(plan)
        _write_plan(plan_dir, plan)
    return edit


def _set(path, value):
    """Set plan[a][b]... to value; `path` dotted ("a.0.b", list indices as numbers) or a
    tuple of keys."""
    def change(plan):
        parts = path if isinstance(path, tuple) else path.split(".")
        *parents, last = [int(p) if p.isdigit() else p for p in parts]
        node = plan
        for part in parents:
            node = node[part]
        node[last] = value
    return _edit(change)


def _drop(key):
    return _edit(lambda plan: plan.pop(key))


def _bytes(name, make):
    def corrupt(plan_dir, other):
        (plan_dir / name).write_bytes(make((plan_dir / name).read_bytes()))
    return corrupt


def _swap(plan_dir, other):
    a, b = plan_dir / "sharded.jaxexport", plan_dir / "reference.jaxexport"
    data = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(data)


def _foreign_plan_json(plan_dir, other):
    shutil.copy(other / "plan.json", plan_dir / "plan.json")


def _missing(name):
    return lambda plan_dir, other: (plan_dir / name).unlink()


# (corruption, the file named, the field or words in the message)
CASES = {
    "truncated plan.json": (_bytes("plan.json", lambda d: d[: len(d) // 2]), "plan.json",
                            "not valid JSON"),
    "empty plan.json": (_bytes("plan.json", lambda d: b""), "plan.json", "not valid JSON"),
    "non-UTF-8 plan.json": (_bytes("plan.json", lambda d: b"\xff\xfe" + d), "plan.json",
                            "not UTF-8"),
    "list plan.json": (_bytes("plan.json", lambda d: b"[1, 2]"), "plan.json",
                       "expected a JSON object"),
    "missing mesh": (_drop("mesh"), "plan.json", "mesh: missing"),
    "missing digests": (_drop("digests"), "plan.json", "digests: missing"),
    "zero axis size": (_set("mesh.axis_sizes", [0]), "plan.json", "mesh.axis_sizes[0]"),
    "wrong axis size": (_set("mesh.axis_sizes", [4]), "plan.json", "mesh.devices"),
    "axis name": (_set("mesh.axis_names", ["\u00e9"]), "plan.json", "mesh.axis_names[0]"),
    "format": (_set("format", 99), "plan.json", "format"),
    "estimate": (_set("estimate.step_time_s", "fast"), "plan.json", "estimate.step_time_s"),
    "spec of an unknown axis": (_set("arguments.0.spec", [["nope"]]), "plan.json",
                                "arguments[0].spec[0]"),
    "absolute file name": (_set(("files", "sharded.jaxexport"), "/etc/passwd"), "plan.json",
                           "leaves the plan directory"),
    "file name with ..": (_set(("files", "loader.py"), "../../loader.py"), "plan.json",
                          "leaves the plan directory"),
    "pipeline task outside": (_set("pipeline", {"tasks": [{"file": "../x.jaxexport",
                                                           "stage": 0}],
                                                "submeshes": [{"axis_names": ["x"],
                                                               "axis_sizes": [2],
                                                               "devices": [0, 1]}]}),
                              "plan.json", "pipeline.tasks[0].file"),
    "rematerialized": (_set("rematerialized", {"values": 1}), "plan.json", "rematerialized"),
    "donation": (_set("donation", {"arguments": [99]}), "plan.json", "donation.arguments"),
    "missing artifact": (_missing("sharded.jaxexport"), "sharded.jaxexport", "cannot read"),
    "truncated artifact": (_bytes("sharded.jaxexport", lambda d: d[:100]), "sharded.jaxexport",
                           "does not match"),
    "swapped artifacts": (_swap, "jaxexport", "does not match"),
    "another plan's plan.json": (_foreign_plan_json, "plan", "does not match"),
    "edited loader": (_bytes("loader.py", lambda d: d + b"\nprint('hi')\n"), "loader.py",
                      "does not match"),
}


@pytest.fixture
def corrupted(plans, tmp_path, request):
    first, other = plans
    target = tmp_path / "plan"
    shutil.copytree(first, target)
    corrupt, file, words = CASES[request.param]
    corrupt(target, other)
    return target, file, words


@pytest.mark.parametrize("corrupted", sorted(CASES), indirect=True)
def test_malformed_plan_is_refused_by_load_run_and_explain(corrupted):
    plan_dir, file, words = corrupted
    with pytest.raises(PlanLoadError) as error:
        hloplan.load(plan_dir)
    assert file in (error.value.file or ""), str(error.value)
    assert words in str(error.value)
    commands = [("run", plan_dir, "--check"), ("explain", plan_dir)]
    if words == "donation.arguments":  # explain shows donation, never runs it
        commands.pop()
    for command in commands:
        result = run(*command)
        assert result.exit_code == 2, (command, result.output)
        assert "Traceback" not in result.output
        if command[0] == "run":
            assert words in result.output and file in result.output


def test_plan_load_error_is_public_and_names_file_and_field(plans, tmp_path):
    target = tmp_path / "plan"
    shutil.copytree(plans[0], target)
    _set("mesh.axis_sizes", [0])(target, None)
    with pytest.raises(hloplan.PlanLoadError) as error:
        read_plan(target)
    assert error.value.file == str(target / "plan.json")
    assert error.value.field == "mesh.axis_sizes[0]"


def test_plan_json_records_a_digest_of_every_artifact(plans):
    plan_dir = plans[0]
    plan = _plan(plan_dir)
    import hashlib

    assert set(plan["digests"]) == set(plan["files"].values())
    for name, digest in plan["digests"].items():
        assert hashlib.sha256((plan_dir / name).read_bytes()).hexdigest() == digest


def test_inputs_npz_with_object_arrays_is_refused(plans, tmp_path):
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, arg0=np.array([{"a": 1}], dtype=object))
    result = run("run", plans[0], "--check", "--inputs", inputs)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "object arrays" in result.output.lower()


def test_trusted_loader_never_runs_the_plans_pipeline_loader(plans, tmp_path):
    """loader.py on a host without hloplan loads a pipelined plan with the pipeline_loader.py
    beside itself, never the one in the plan directory it is given."""
    untrusted = tmp_path / "untrusted"
    shutil.copytree(plans[0], untrusted)
    marker = tmp_path / "executed"
    (untrusted / "pipeline_loader.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    shutil.copy(plans[0] / "loader.py", trusted / "loader.py")
    script = textwrap.dedent(f"""
        import sys
        sys.modules['hloplan'] = None  # a deployment host: hloplan is not installed
        sys.path.insert(0, {str(trusted)!r})
        import loader
        try:
            loader._pipeline_loader()
        except loader.PlanLoadError as exc:
            print('refused', exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=untrusted)
    assert done.returncode == 0, done.stderr
    assert "refused" in done.stdout and "pipeline_loader.py" in done.stdout
    assert not marker.exists()


def test_explain_escapes_control_characters(plans, tmp_path):
    target = tmp_path / "plan"
    shutil.copytree(plans[0], target)
    plan = _plan(target)
    plan["arguments"][0]["name"] = "evil\x1b[2J\x1b]0;owned\x07"
    plan["device_model"]["name"] = "dev\x1b[31m"
    _write_plan(target, plan)
    result = run("explain", target)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output
    assert "\\x1b[31m" in result.output


def test_workers_never_import_from_the_working_directory(plans, tmp_path):
    """`run --processes` started from a directory holding json.py and hloplan/: neither runs."""
    marker = tmp_path / "imported"
    evil = tmp_path / "evil"
    (evil / "hloplan").mkdir(parents=True)
    for module in (evil / "json.py", evil / "argparse.py", evil / "hloplan" / "__init__.py"):
        module.write_text(f"open({str(marker)!r}, 'a').write({module.name!r})\n")
    from hloplan.multiprocess import isolated_python

    probe = subprocess.run([*isolated_python("hloplan.verify"), "--help"], cwd=evil,
                           capture_output=True, text=True, timeout=120)
    assert not marker.exists(), (marker.read_text(), probe.stderr)
    cwd = os.getcwd()
    os.chdir(evil)
    try:
        result = run("run", plans[0], "--processes", "2")
    finally:
        os.chdir(cwd)
    assert result.exit_code == 0, result.output
    assert not marker.exists(), marker.read_text()


# --------------------------------------------------------------------------- atomic writes


def _files(tag: str, size: int = 4096) -> dict[str, bytes]:
    """A plan-like set of files whose every byte says which write it belongs to."""
    blob = (tag.encode() * (size // len(tag) + 1))[:size]
    names = ["sharded.jaxexport", "reference.jaxexport", "module.mlir", "loader.py"]
    files = {name: blob for name in names}
    files["plan.json"] = json.dumps({"format": 1, "files": {n: n for n in names},
                                     "tag": tag, "size": size}).encode()
    return files


# The writer processes' preamble: artifact (no jax) and _files.
WRITER = "import json\nfrom hloplan.emit import artifact\n" + textwrap.dedent(
    inspect.getsource(_files))


def _complete(target: Path) -> str:
    """The tag of the one complete write at `target` (fails on a mixed or partial plan)."""
    plan = json.loads((target / "plan.json").read_text())
    tag = plan["tag"]
    for name in plan["files"]:
        assert (target / name).read_bytes() == _files(tag, plan["size"])[name], name
    return tag


def test_replacing_keeps_user_files_and_foreign_directories(tmp_path):
    target = tmp_path / "out"
    artifact.write_plan_dir(target, _files("a"), {})
    (target / "notes.txt").write_text("mine")
    with pytest.raises(hloplan.diagnostics.UsageError, match="notes.txt"):
        artifact.write_plan_dir(target, _files("b"), {})
    assert (target / "notes.txt").read_text() == "mine" and _complete(target) == "a"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "plan.json").write_text('{"mine": true}')
    with pytest.raises(hloplan.diagnostics.UsageError, match="no hloplan plan.json"):
        artifact.write_plan_dir(foreign, _files("b"), {})
    assert (foreign / "plan.json").read_text() == '{"mine": true}'


def test_stale_staging_directories_are_cleaned_and_a_half_swap_undone(tmp_path):
    target = tmp_path / "out"
    artifact.write_plan_dir(target, _files("a"), {})
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f".out{artifact.STAGING_TAG}{dead}-abc"
    stale.mkdir()
    (stale / "half").write_bytes(b"x")
    # A write without RENAME_EXCHANGE killed between its renames: the old plan is hidden.
    os.rename(target, tmp_path / f".out{artifact.STAGING_TAG}{dead}-def{artifact.OLD_SUFFIX}")
    assert artifact.clean_stale(target)
    assert _complete(target) == "a"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_kills_at_any_moment_leave_one_complete_plan(tmp_path, exchange):
    """A writer replacing the plan in a loop is SIGKILLed at random moments: `out` always
    holds one complete plan, and the next write leaves no hidden directory behind."""
    if exchange and artifact._EXCHANGE is None:
        pytest.skip("renameat2 is not available here")
    target = tmp_path / "out"
    artifact.write_plan_dir(target, _files("seed"), {})
    script = WRITER + textwrap.dedent(f"""
        import itertools
        if not {exchange!r}:
            artifact._EXCHANGE = None
        print("ready", flush=True)
        for i in itertools.count():
            artifact.write_plan_dir({str(target)!r}, _files(f"w{{i}}", 200_000), {{}})
    """)
    rng = np.random.default_rng(int(os.environ.get("HLOPLAN_FUZZ_SEED", "0")))
    kills = int(os.environ.get("HLOPLAN_KILLS", "12"))
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=tmp_path)
        assert proc.stdout.readline().strip() == b"ready", proc.stderr.read()
        time.sleep(float(rng.uniform(0.0, 0.05)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if not exchange:  # a kill between the two renames: the next compile undoes it first
            artifact.clean_stale(target)
        _complete(target)
    artifact.write_plan_dir(target, _files("last"), {})
    assert _complete(target) == "last"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_concurrent_writers_both_succeed_and_one_plan_wins(tmp_path):
    target = tmp_path / "out"
    script = WRITER + textwrap.dedent(f"""
        import sys
        for i in range(15):
            artifact.write_plan_dir({str(target)!r}, _files(sys.argv[1] + str(i), 100_000), {{}})
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, tag], stderr=subprocess.PIPE,
                              cwd=tmp_path) for tag in ("a", "b")]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
    assert _complete(target) in ("a14", "b14")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_hand_edited_pipeline_sections_are_usage_errors(tmp_path):
    plan = tmp_path / "plan"
    result = run("compile", FIXTURES / "mlp_train_step.mlir", "--mesh", "4", "--device", "toy",
                 "--stages", "2", "--microbatches", "2", "-o", plan)
    assert result.exit_code == 0 and _plan(plan)["pipeline"]["tasks"], result.output
    for name, edit in (("inputs", lambda p: p["pipeline"]["tasks"][0].pop("inputs")),
                       ("order", lambda p: p["pipeline"].pop("order"))):
        target = tmp_path / name
        shutil.copytree(plan, target)
        _edit(edit)(target, None)
        for command in (("run", target, "--check"), ("explain", target)):
            result = run(*command)
            assert result.exit_code == 2, (name, command, result.output)
            assert repr(name) in result.output and "Traceback" not in result.output


def test_deeply_nested_plan_json_is_refused(plans, tmp_path):
    target = tmp_path / "plan"
    shutil.copytree(plans[0], target)
    (target / "plan.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(PlanLoadError, match="not valid JSON"):
        read_plan(target)
    assert run("explain", target).exit_code == 2
