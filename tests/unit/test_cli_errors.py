"""Bad input gets a located diagnostic, the right exit code, and leaves nothing half-written;
good input gives byte-identical plans run after run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from hloplan.cli import main

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MLP = FIXTURES / "mlp_train_step.mlir"


def run(*args, input_bytes=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input_bytes,
                              catch_exceptions=False)


def test_malformed_mlir_is_located(tmp_path):
    bad = tmp_path / "bad.mlir"
    bad.write_text("module {\n  func.func @main(%a: tensor<4xf32>) -> tensor<4xf32> {\n"
                   "    %0 = stablehlo.add %a, %b : tensor<4xf32>\n"
                   "    return %0 : tensor<4xf32>\n  }\n}\n")
    result = run("compile", bad, "--mesh", "2", "-o", tmp_path / "plan")
    assert result.exit_code == 1
    assert f"{bad}:3:" in result.output and "error:" in result.output
    assert not (tmp_path / "plan").exists()


def test_not_stablehlo_and_truncated_exported(tmp_path):
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x00\x01\x02 not a program")
    truncated = tmp_path / "truncated.jaxexport"
    truncated.write_bytes((FIXTURES / "mlp_train_step.jaxexport").read_bytes()[:300])
    for path in (garbage, truncated):
        result = run("compile", path, "--mesh", "2")
        assert result.exit_code == 1
        assert f"{path}:1:1: error: input is neither StableHLO" in result.output


def test_dynamic_shapes_are_refused(tmp_path):
    dynamic = tmp_path / "dyn.mlir"
    dynamic.write_text("func.func public @main(%arg0: tensor<?x8xf32>) -> tensor<?x8xf32> {\n"
                       "  return %arg0 : tensor<?x8xf32>\n}\n")
    result = run("compile", dynamic, "--mesh", "2")
    assert result.exit_code == 1
    assert "dynamic shape" in result.output and f"{dynamic}:1:" in result.output


def test_unknown_custom_call_is_replicated_with_a_located_warning(tmp_path):
    program = tmp_path / "custom.mlir"
    program.write_text(
        'func.func public @main(%arg0: tensor<16x16xf32>) -> tensor<16x16xf32> {\n'
        '  %0 = stablehlo.custom_call @my_kernel(%arg0) : (tensor<16x16xf32>) -> tensor<16x16xf32> '
        'loc("model.py":7:3)\n'
        '  return %0 : tensor<16x16xf32>\n}\n')
    result = run("compile", program, "--mesh", "2", "-o", tmp_path / "plan")
    assert result.exit_code == 0
    assert "model.py:7:3: warning: custom_call @my_kernel" in result.output
    assert "replicated" in result.output


@pytest.mark.parametrize("mesh,message", [
    ("8x0", "axis sizes must be positive"),
    ("axb", "mesh 'axb'"),
    ("1x2x3x4", "mesh '1x2x3x4'"),
    ("data=2,data=2", "data"),
    ("1024x1024x1024", "up to 1,048,576"),
])
def test_bad_mesh_is_a_usage_error(mesh, message):
    result = run("compile", MLP, "--mesh", mesh)
    assert result.exit_code == 2
    assert message in result.output


def _prime_program(tmp_path):
    """A matmul whose every dim is prime (7, 11): no mesh axis but 7 or 11 divides any of them."""
    program = tmp_path / "prime.mlir"
    program.write_text(
        "func.func public @main(%arg0: tensor<7x11xf32>, %arg1: tensor<11x7xf32>) -> tensor<7x7xf32> {\n"
        "  %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0] : "
        "(tensor<7x11xf32>, tensor<11x7xf32>) -> tensor<7x7xf32>\n"
        "  return %0 : tensor<7x7xf32>\n}\n")
    return program


def test_mesh_that_does_not_divide_tensors_is_planned_around(tmp_path):
    # Every dim is prime (7, 11): no split divides it, so the plan replicates, and says so
    # through its specs rather than crashing.
    program = _prime_program(tmp_path)
    result = run("compile", program, "--mesh", "2x4", "-o", tmp_path / "plan")
    assert result.exit_code == 0
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert all(not any(spec) for spec in (a["spec"] for a in plan["arguments"]))


def test_budget_nothing_fits_says_by_how_much(tmp_path):
    result = run("compile", MLP, "--mesh", "2", "--memory-budget", "1KiB", "-o", tmp_path / "p")
    assert result.exit_code == 1
    assert "no plan fits the memory budget of 1.00 KiB" in result.output
    assert "over budget" in result.output and "largest tensors" in result.output
    assert "no plan fits by accumulating gradients over 2 to" in result.output
    assert not (tmp_path / "p").exists()


def test_bad_budget_and_device_are_usage_errors():
    assert run("compile", MLP, "--mesh", "2", "--memory-budget", "lots").exit_code == 2
    result = run("compile", MLP, "--mesh", "2", "--device", "abacus")
    assert result.exit_code == 2 and "known models" in result.output


def test_output_directory_that_is_not_a_plan_is_not_overwritten(tmp_path):
    precious = tmp_path / "out"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    result = run("compile", MLP, "--mesh", "2", "-o", precious)
    assert result.exit_code == 2
    assert (precious / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in precious.iterdir()) == ["notes.txt"]


def test_stdin_input_and_json_output(tmp_path):
    result = run("compile", "-", "--mesh", "2", "--format", "json", "-o", tmp_path / "p",
                 input_bytes=MLP.read_bytes())
    assert result.exit_code == 0
    payload = json.loads(result.stdout)
    assert payload["ok"] and payload["solver"]["status"] == "optimal"


def test_json_errors_are_json():
    result = run("compile", MLP, "--mesh", "2", "--memory-budget", "1KiB", "--format", "json")
    assert result.exit_code == 1
    payload = json.loads(result.stdout)
    assert payload["ok"] is False and payload["diagnostics"][0]["severity"] == "error"


def test_time_limit_keeps_a_plan_and_exits_zero(tmp_path):
    result = run("compile", FIXTURES / "gpt_train_step.mlir", "--mesh", "2x4", "--device", "toy",
                 "--memory-budget", "600KiB", "--time-limit", "0.5", "-o", tmp_path / "p")
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert result.exit_code == 0
    if plan["solver"]["status"] == "time_limit":
        assert "time limit" in result.output and "gap" in result.output
    else:  # solved to optimality within the limit: nothing to warn about
        assert plan["solver"]["gap"] <= 1e-6


def test_no_plan_found_in_time_is_a_diagnostic_not_a_crash(tmp_path, monkeypatch):
    from hloplan.passes import solve_sharding
    from hloplan.solver.ilp import SolverError

    def no_plan(*args, **kwargs):
        raise SolverError("highs found no solution within 0.5 s; raise the time limit")

    monkeypatch.setattr(solve_sharding.axes, "solve", no_plan)
    result = run("compile", MLP, "--mesh", "2", "-o", tmp_path / "p")
    assert result.exit_code == 1
    assert "error: no plan found for mesh" in result.output
    assert "raise the time limit" in result.output
    assert not (tmp_path / "p").exists()


def test_compile_twice_gives_byte_identical_plans(tmp_path):
    for name in ("a", "b"):
        assert run("compile", MLP, "--mesh", "2x4", "--device", "toy",
                   "-o", tmp_path / name).exit_code == 0
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*")
                   if p.is_file() and p.name != "timings.json")
    assert files
    for path in files:
        assert (tmp_path / "a" / path).read_bytes() == (tmp_path / "b" / path).read_bytes(), path


def test_print_after_and_time_passes():
    result = run("compile", MLP, "--mesh", "2", "--print-after", "propagate-sharding",
                 "--time-passes", "-q")
    assert result.exit_code == 0
    assert "IR Dump After propagate-sharding" in result.stderr
    assert "solve-sharding" in result.stderr
    assert run("compile", MLP, "--mesh", "2", "--print-after", "nope").exit_code == 2


def test_reproducer_holds_input_command_and_problem(tmp_path):
    result = run("compile", MLP, "--mesh", "2", "--reproducer", tmp_path / "repro", "-q")
    assert result.exit_code == 0
    names = sorted(p.name for p in (tmp_path / "repro").iterdir())
    assert names == ["command.txt", "input.mlir", "problem.json"]
    problem = json.loads((tmp_path / "repro" / "problem.json").read_text())
    assert problem["nodes"]


def test_decompose_flag_plans_three_axis_meshes_on_axis_views(tmp_path):
    views = run("compile", MLP, "--mesh", "2x2x2", "--decompose", "always", "--format", "json",
                "-q", "-o", tmp_path / "views")
    whole = run("compile", MLP, "--mesh", "2x2x2", "--decompose", "never", "--format", "json",
                "-q", "-o", tmp_path / "whole")
    assert views.exit_code == 0 and whole.exit_code == 0, views.output + whole.output
    solvers = [json.loads((tmp_path / d / "plan.json").read_text())["solver"]
               for d in ("views", "whole")]
    assert solvers[0]["status"] == "decomposed" and solvers[1]["status"] == "optimal"
    # Axis views can only miss the whole ILP's optimum, never beat it.
    assert solvers[0]["objective_s"] >= solvers[1]["objective_s"] * (1 - 1e-6)
    bad = run("compile", MLP, "--mesh", "2x2x2", "--decompose", "sometimes")
    assert bad.exit_code == 2 and "--decompose" in bad.output


def test_gap_flag_is_checked_and_reported(tmp_path):
    strict = run("compile", MLP, "--mesh", "2x4", "--gap", "0", "--format", "json", "-q",
                 "-o", tmp_path / "strict")
    assert strict.exit_code == 0, strict.output
    solver = json.loads((tmp_path / "strict" / "plan.json").read_text())["solver"]
    assert solver["status"] == "optimal" and solver["gap"] <= 1e-6
    bad = run("compile", MLP, "--mesh", "2x4", "--gap", "2", "-o", tmp_path / "bad")
    assert bad.exit_code == 2 and "--gap" in bad.output
    assert not (tmp_path / "bad").exists()


# --------------------------------------------------------------------------- hostile inputs

MLP_FORWARD = FIXTURES / "mlp_forward.mlir"
TUPLE_MAIN = """func.func public @main(%arg0: tuple<tensor<4xf32>, tensor<4xf32>>) -> tensor<4xf32> {
  %0 = stablehlo.get_tuple_element %arg0[0] : (tuple<tensor<4xf32>, tensor<4xf32>>) -> tensor<4xf32>
  return %0 : tensor<4xf32>
}
"""
NO_MAIN = """func.func public @step(%arg0: tensor<8x4xf32>) -> tensor<8x4xf32> {
  %0 = stablehlo.add %arg0, %arg0 : tensor<8x4xf32>
  return %0 : tensor<8x4xf32>
}
"""
# jax.jit(f).lower(x).as_text() of f(x) = 2 * jax.pure_callback(np.sin, ...)(x)
CALLBACK = """module @jit_f attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @maximal_mesh_0 = <[], device_ids=[0]>
  func.func public @main(%arg0: tensor<8x4xf32>) -> (tensor<8x4xf32> {jax.result_info = "result"}) {
    %0 = stablehlo.custom_call @xla_ffi_python_cpu_callback(%arg0) {backend_config = "", mhlo.backend_config = {index = 0 : ui64}, operand_layouts = [dense<[1, 0]> : tensor<2xindex>], result_layouts = [dense<[1, 0]> : tensor<2xindex>], sdy.sharding = #sdy.sharding_per_value<[<@maximal_mesh_0, []>]>} : (tensor<8x4xf32>) -> tensor<8x4xf32>
    %1 = stablehlo.add %0, %0 : tensor<8x4xf32>
    return %1 : tensor<8x4xf32>
  }
}
"""


def _corrupted_exported() -> bytes:
    data = bytearray((FIXTURES / "mlp_forward.jaxexport").read_bytes())
    for i in range(1000, 1100):
        data[i] ^= 0xA5
    return bytes(data)


def _non_utf8_mlir() -> bytes:
    text = MLP_FORWARD.read_bytes()
    cut = text.index(b"\n", 200) + 1
    return text[:cut] + b"\xff\xfe" + text[cut:]


@pytest.mark.parametrize("name,data,where,message", [
    ("corrupt.jaxexport", _corrupted_exported(), ":1:1:", "cannot be read"),
    ("tuple.mlir", TUPLE_MAIN.encode(), ":1:", "argument 0 (unnamed) has type tuple<"),
    ("nomain.mlir", NO_MAIN.encode(), ":1:1:", "no @main function"),
    ("callback.mlir", CALLBACK.encode(), ":4:10:", "calls back into the Python process"),
    ("truncated.mlir", MLP_FORWARD.read_bytes()[:40], ":", "error:"),
    ("latin1.mlir", _non_utf8_mlir(), None, "not UTF-8"),
    # The bindings abort the process when a string that is not UTF-8 is read.
    ("escape.mlir", NO_MAIN.replace("@step", "@main").replace(
        ": tensor<8x4xf32>\n  return", ': tensor<8x4xf32> loc("\\FF")\n  return').encode(),
     ":2:", "a string that is not UTF-8"),
    ("truncated.vhlo", (FIXTURES / "mlp_train_step.vhlo").read_bytes()[:1500], ":1:1:",
     "error:"),
])
def test_hostile_input_is_a_located_error(tmp_path, name, data, where, message):
    path = tmp_path / name
    path.write_bytes(data)
    result = run("compile", path, "--mesh", "2", "-o", tmp_path / "plan")
    assert result.exit_code == 1, result.output
    assert "internal compiler error" not in result.output and message in result.output
    if where is None:  # the line and column of the first byte that is not UTF-8
        text = MLP_FORWARD.read_bytes()
        line = text[:text.index(b"\n", 200) + 1].count(b"\n") + 1
        where = f":{line}:1:"
    assert f"{path}{where}" in result.output and ":0:0:" not in result.output
    assert not (tmp_path / "plan").exists()
    explained = run("explain", path, "--mesh", "2")
    assert explained.exit_code == 1 and "Traceback" not in explained.output


def test_non_utf8_device_file_is_a_usage_error(tmp_path):
    device = tmp_path / "dev.toml"
    device.write_bytes(b'name = "\xff\xfe"\n')
    result = run("compile", MLP_FORWARD, "--mesh", "2", "--device", device)
    assert result.exit_code == 2 and "not UTF-8" in result.output


def test_absurd_device_numbers_are_refused(tmp_path):
    device = tmp_path / "slow.toml"
    toy = (Path(__file__).resolve().parents[2] / "cost_models" / "toy.toml").read_text()
    device.write_text(toy.replace("f32 = 1e8", "f32 = 1e-300"))
    result = run("compile", MLP_FORWARD, "--mesh", "2", "--device", device)
    assert result.exit_code == 2 and "flops.f32" in result.output


@pytest.mark.parametrize("args,message", [
    (("--mesh", "\u00e9=8"), "is not an identifier"),
    (("--mesh", "2", "--time-limit", "-1"), "--time-limit"),
    (("--mesh", "2", "--time-limit", "nan"), "--time-limit"),
    (("--mesh", "2", "-o", ""), "output directory name is empty"),
])
def test_bad_options_are_usage_errors(args, message):
    result = run("compile", MLP_FORWARD, *args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_unwritable_outputs_are_usage_errors(tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for output in (afile / "sub", afile, "/proc/hloplan-plan", "/sys/hloplan-plan"):
        result = run("compile", MLP_FORWARD, "--mesh", "2", "-o", output)
        assert result.exit_code == 2, (output, result.output)
        assert "internal compiler error" not in result.output
    result = run("compile", MLP_FORWARD, "--mesh", "2", "--reproducer", afile / "repro")
    assert result.exit_code == 2 and "--reproducer" in result.output
    plan = tmp_path / "plan"
    assert run("compile", MLP_FORWARD, "--mesh", "2", "-o", plan).exit_code == 0
    monkeypatch.chdir(plan)
    result = run("compile", MLP_FORWARD, "--mesh", "2", "-o", ".")
    assert result.exit_code == 2 and "working directory" in result.output
    assert (plan / "plan.json").exists()


def test_mesh_axes_nothing_can_use_are_named(tmp_path):
    program = _prime_program(tmp_path)
    result = run("compile", program, "--mesh", "3x5", "-o", tmp_path / "plan")
    assert result.exit_code == 0
    assert "warning: mesh axes x=3, y=5 divide no dimension" in result.output
    result = run("compile", program, "--mesh", "2x7", "-o", tmp_path / "plan3")
    assert "warning: mesh axis x=2 divides no dimension" in result.output
    result = run("compile", MLP_FORWARD, "--mesh", "2", "-o", tmp_path / "plan2")
    assert "divide no dimension" not in result.output


def test_control_characters_from_the_input_are_escaped(tmp_path):
    program = tmp_path / "custom.mlir"
    program.write_text(
        'func.func public @main(%arg0: tensor<16x16xf32>) -> tensor<16x16xf32> {\n'
        '  %0 = stablehlo.custom_call @my_kernel(%arg0) : (tensor<16x16xf32>) -> tensor<16x16xf32> '
        'loc("mo\\1B[2Jdel.py":7:3)\n'
        '  return %0 : tensor<16x16xf32>\n}\n')
    result = run("compile", program, "--mesh", "2", "-o", tmp_path / "plan")
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "mo\\x1b[2Jdel.py:7:3: warning" in result.output
