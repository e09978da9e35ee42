"""`hloplan explain` and the decisions plan.json records: text, json, jax and svg output, error
exits, and the local next-best arithmetic against solver.explain."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402
import math  # noqa: E402
import xml.etree.ElementTree as ET  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402

import hloplan  # noqa: E402
from hloplan import decisions, explain_report  # noqa: E402
from hloplan.cli import main  # noqa: E402
from hloplan.solver.evaluate import evaluate  # noqa: E402
from hloplan.solver.explain import compare, next_best  # noqa: E402
from hloplan.solver.problem import Edge, LivePoint, Node, ShardingProblem, Solution, Strategy  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MLP = FIXTURES / "mlp_train_step.jaxexport"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("explain") / "plan"
    result = hloplan.compile(str(MLP), mesh="2x4", device="toy", output=str(out))
    return result, out


def _run(*args):
    return CliRunner().invoke(main, ["explain", *map(str, args)])


def test_text_names_every_argument_and_the_mesh(compiled):
    result, plan_dir = compiled
    out = _run(plan_dir, "--verbose")
    assert out.exit_code == 0, out.output
    text = out.stdout
    for argument in result.plan["arguments"]:
        assert argument["name"] in text
    assert "x=2, y=4" in text
    for section in ("Mesh", "Device model", "Arguments", "Results", "Estimated step time",
                    "Peak memory", "Top", "Decisions"):
        assert section in text
    assert "models.py:45" in text  # the top ops carry their source lines
    assert "█" in text  # the bars


def test_text_opens_with_the_strategy_and_stays_short(compiled):
    result, plan_dir = compiled
    out = _run(plan_dir)
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    first = " ".join(lines[1:3])
    assert explain_report.strategy_paragraph(result.plan)[:40] in first
    assert "parallel" in first or "replicated" in first
    assert len(lines) < len(_run(plan_dir, "--verbose").stdout.splitlines())
    assert "--verbose lists all" in out.stdout
    assert "Device model" not in out.stdout  # verbose only
    assert "models.py:45" in out.stdout  # source lines: the file's name and the line


def test_plan_records_the_collective_merging_it_was_priced_with(compiled):
    result, _ = compiled
    # toy.toml has no [combiner]: XLA's GPU thresholds, all-gathers never merged
    assert result.plan["device_model"]["combiner"] == {
        "all-gather": 0, "all-reduce": 30 * 2**20, "reduce-scatter": 30 * 2**20}


def test_json_has_decisions_with_reasons(compiled):
    _, plan_dir = compiled
    out = _run(plan_dir, "--format", "json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["ok"] is True
    assert data["mesh"]["axis_names"] == ["x", "y"]
    assert data["decisions"], "a 2x4 plan of an MLP has choices to explain"
    for d in data["decisions"]:
        assert isinstance(d["reason"], str) and len(d["reason"]) > 20
        assert d["chosen"] != d["next_best"]
        assert set(d["delta"]) == {"compute_s", "communication_s", "resharding_s", "total_s",
                                   "peak_memory_bytes", "bytes_per_device"}
    kinds = {d["kind"] for d in data["decisions"]}
    assert kinds == {"argument", "op"}
    ops = [d for d in data["decisions"] if d["kind"] == "op"]
    assert all(d["location"] and d["location"].startswith("fixtures/models.py:") for d in ops)
    parts = {p["name"]: p["seconds"] for p in data["step_time_breakdown"]}
    est = data["estimate"]
    assert math.isclose(sum(parts.values()), est["step_time_s"], rel_tol=1e-4)
    assert data["top_ops"] and data["top_ops"][0]["total_s"] >= data["top_ops"][-1]["total_s"]


def test_the_peak_is_itemised_where_it_is(compiled):
    """plan.json names the program point of the estimated peak and the largest values held
    there (adding up, with the rest, to the peak); explain charts the largest activations one
    by one and says where the peak is."""
    result, plan_dir = compiled
    est = result.plan["estimate"]
    peak = est["peak"]
    assert peak["after"].startswith("after %")
    held = sum(e["bytes"] for e in peak["largest"]) + peak["others_bytes"] + peak["fixed_bytes"]
    assert held == est["peak_memory_bytes"]
    assert [e["bytes"] for e in peak["largest"]] == sorted(
        (e["bytes"] for e in peak["largest"]), reverse=True)
    activations = [e for e in peak["largest"] if e["op"] != "arg"]
    assert activations and all(e["location"] for e in activations)
    text = _run(plan_dir).stdout
    assert f"the estimated peak is {peak['after']}" in text
    assert activations[0]["id"] + " " in text
    data = json.loads(_run(plan_dir, "--format", "json").stdout)
    parts = data["memory"]["parts"]
    assert math.isclose(sum(p["bytes"] for p in parts), est["peak_memory_bytes"], rel_tol=1e-9)
    assert data["memory"]["after"] == peak["after"]


def test_plan_json_decisions_are_deterministic(compiled):
    result, _ = compiled
    again = json.loads(json.dumps(decisions.top_decisions(result.state, count=10)))
    assert again == result.plan["decisions"]
    assert len(again) == 10
    assert [d["rank"] for d in again] == list(range(1, 11))


def test_jax_format_runs_as_pasted(compiled):
    """The emitted code builds the mesh over jax.devices(), NamedShardings matching the
    argument and result trees, and a jitted step that gives the single-device answer."""
    import numpy as np
    from jax.sharding import NamedSharding

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    _, plan_dir = compiled
    out = _run(plan_dir, "--format", "jax")
    assert out.exit_code == 0, out.output
    namespace: dict = {}
    exec(compile(out.stdout, "<explain --format jax>", "exec"), namespace)
    exported = explain_report.load_exported(plan_dir)
    args, _ = jax.tree.unflatten(exported.in_tree, [0] * exported.in_tree.num_leaves)
    is_named = lambda x: isinstance(x, NamedSharding)  # noqa: E731
    assert (jax.tree.structure(namespace["in_shardings"], is_leaf=is_named)
            == jax.tree.structure(tuple(args)))
    results = jax.tree.unflatten(exported.out_tree, [0] * exported.out_tree.num_leaves)
    assert (jax.tree.structure(namespace["out_shardings"], is_leaf=is_named)
            == jax.tree.structure(results))
    plan = json.loads((plan_dir / "plan.json").read_text())
    by_name = {a["name"]: decisions.partition_spec_text(a["spec"]) for a in plan["arguments"]}
    assert repr(namespace["in_shardings"][1].spec).replace("PartitionSpec", "P") == by_name["x"]
    assert namespace["mesh"].shape == {"x": 2, "y": 4}

    inputs = np.load(FIXTURES / "mlp_train_step.inputs.npz")
    flat = [inputs[f"arg{i}"] for i in range(len(inputs.files))]
    call_args = jax.tree.unflatten(jax.tree.structure(tuple(args)), flat)
    got = namespace["step"](*call_args)
    reference = jax.export.deserialize(bytearray((plan_dir / "reference.jaxexport").read_bytes()))
    want = reference.call(*call_args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
    sharded = [leaf for leaf in jax.tree.leaves(got) if leaf.ndim]
    assert any(not leaf.sharding.is_fully_replicated for leaf in sharded)


def test_svg_is_written(compiled, tmp_path):
    _, plan_dir = compiled
    svg = tmp_path / "plan.svg"
    out = _run(plan_dir, "--svg", svg)
    assert out.exit_code == 0, out.output
    text = svg.read_text()
    assert text.startswith("<svg") or text.startswith("<?xml")
    root = ET.fromstring(text)
    assert root.tag.endswith("svg")
    assert "Estimated step time" in text and "params[1].w" in text


def test_png_is_written_and_pictures_the_mesh(compiled, tmp_path):
    _, plan_dir = compiled
    png, svg = tmp_path / "plan.png", tmp_path / "plan.svg"
    out = _run(plan_dir, "--png", png, "--svg", svg)
    assert out.exit_code == 0, out.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = svg.read_text()
    # the mesh's axes, each device, and the tensors whose blocks the devices hold
    assert "axis y" in text and "axis x" in text
    assert "batch x" in text and "parameter params[1].w" in text


def _plan(args, results=(), axes=("x", "y"), sizes=(2, 4), **extra):
    def entry(name, shape, spec, dtype="f32"):
        count = 1
        for dim in shape:
            count *= dim
        return {"name": name, "shape": list(shape), "dtype": dtype, "spec": spec,
                "bytes": 4 * count, "bytes_per_device": 4 * count}

    return {"mesh": {"axis_names": list(axes), "axis_sizes": list(sizes)},
            "arguments": [entry(*a) for a in args], "results": [entry(*r) for r in results],
            "estimate": {"step_time_s": 1e-3, "peak_memory_bytes": 2**20, "collectives": []},
            "ops": [], "device_model": {"name": "h100"}, **extra}


W, B = [1024, 4096], [256, 1024]


def test_strategy_names_data_parallel_and_zero1():
    plan = _plan([("params['w']", W, [[], []]), ("opt['m']['w']", W, [["y"], []]),
                  ("opt['v']['w']", W, [["y"], []]), ("x", B, [["y"], []])],
                 [("result[0]['w']", W, [[], []]), ("result[1]['m']['w']", W, [["y"], []]),
                  ("result[1]['v']['w']", W, [["y"], []])])
    phrases = explain_report.strategy_phrases(plan)
    assert "batch over y: 4-way data parallel" in phrases
    assert "optimizer state sharded over y: 4-way (ZeRO-1)" in phrases
    assert "mesh axis x unused (replicated over it)" in phrases


def test_strategy_names_tensor_parallel_and_fsdp():
    tp = _plan([("params['w']", W, [[], ["x"]]), ("x", B, [["y"], []])])
    assert explain_report.strategy_phrases(tp) == [
        "batch over y: 4-way data parallel",
        "weights split over x: 2-way tensor parallel (largest: params['w'])"]
    fsdp = _plan([("params['w']", W, [["x", "y"], []]), ("tokens", [256, 512], [["x", "y"], []], "i32")])
    assert explain_report.strategy_phrases(fsdp) == [
        "batch over (x, y): 8-way data parallel",
        "parameters sharded over (x, y): 8-way FSDP (ZeRO-3)"]
    seq = _plan([("params['w']", W, [[], []]), ("tokens", [256, 512], [["x"], ["y"]], "i32")])
    assert "sequence over y: 4-way sequence parallel" in explain_report.strategy_phrases(seq)


def test_strategy_names_expert_parallel():
    plan = _plan([("params['experts']['w']", [8, 1024, 4096], [["y"], [], []]),
                  ("x", B, [["x", "y"], []])])
    assert "experts over y: 4-way expert parallel" in explain_report.strategy_phrases(plan)


def test_fully_replicated_is_said_plainly():
    plan = _plan([("params['w']", W, [[], []]), ("x", B, [[], []])])
    assert explain_report.strategy_paragraph(plan).startswith(
        "Fully replicated: every one of the 8 devices runs the whole program")


def test_pipelined_plan_leads_with_its_stages():
    pipe = {"tasks": [{}], "stages": 2, "microbatches": 8, "schedule": "1f1b",
            "submeshes": [{"devices": [0, 1, 2, 3], "shape": [1, 4]},
                          {"devices": [4, 5, 6, 7], "shape": [1, 4]}],
            "estimate": {"step_time_s": 2e-3, "memory_per_stage_bytes": [2**20, 2**19],
                         "bubble_fraction": 1 / 9}}
    plan = _plan([("params['w']", W, [[], ["y"]]), ("x", B, [["y"], []])], pipeline=pipe)
    text = explain_report.strategy_paragraph(plan)
    assert text.startswith("Pipeline: 2 stages on submeshes 1x4 (devices 0-3) + 1x4 (devices "
                           "4-7), 8 microbatches, 1f1b schedule: estimated step 2.00 ms")
    assert "The single-program plan" in text


def test_in_shardings_python_api(compiled):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    _, plan_dir = compiled
    shardings = explain_report.in_shardings(plan_dir)
    exported = explain_report.load_exported(plan_dir)
    args, _ = jax.tree.unflatten(exported.in_tree, [0] * exported.in_tree.num_leaves)
    assert jax.tree.structure(shardings) == jax.tree.structure(tuple(args))
    plan = json.loads((plan_dir / "plan.json").read_text())
    x_spec = next(a["spec"] for a in plan["arguments"] if a["name"] == "x")
    assert decisions.partition_spec_text(explain_report._axes_of(shardings[1].spec)) == (
        decisions.partition_spec_text(x_spec))
    assert shardings[1].mesh.axis_names == ("x", "y")


def test_explain_input_in_memory():
    out = _run(MLP, "--mesh", "8", "--device", "toy", "--format", "json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["mesh"]["axis_sizes"] == [8]
    assert data["decisions"]


@pytest.mark.parametrize("setup", ["empty_dir", "missing", "bad_json", "not_a_plan", "no_mesh"])
def test_errors_exit_2(tmp_path, setup):
    target = tmp_path / "plan"
    if setup == "empty_dir":
        target.mkdir()
    elif setup == "bad_json":
        target.mkdir()
        (target / "plan.json").write_text("{not json")
    elif setup == "not_a_plan":
        target.mkdir()
        (target / "plan.json").write_text(json.dumps({"format": 1}))
    elif setup == "no_mesh":
        target = MLP
    out = _run(target)
    assert out.exit_code == 2, out.output
    assert f"{target}: error: " in out.stderr


def test_mesh_with_plan_dir_is_a_usage_error(compiled):
    _, plan_dir = compiled
    out = _run(plan_dir, "--mesh", "8")
    assert out.exit_code == 2
    assert f"{plan_dir}: error: " in out.stderr


# -- the local next-best arithmetic ------------------------------------------------------------


def _check_against_solver_explain(problem, solution):
    index = decisions.DecisionIndex(problem, solution)
    base = evaluate(problem, solution)
    checked = 0
    for node in range(len(problem.nodes)):
        mine = index.next_best(node)
        ref = next_best(problem, solution, node)
        if ref is None:
            assert mine is None
            continue
        alternative, evaluation = ref
        assert mine.feasible == evaluation.feasible
        assert math.isclose(mine.delta_total, evaluation.total - base.total, rel_tol=1e-9,
                            abs_tol=1e-15)
        assert math.isclose(mine.peak_memory, evaluation.peak_memory, rel_tol=1e-9)
        if mine.strategy != alternative.choice[node]:
            continue  # an exact tie in cost, broken differently by float noise
        reasons = compare(problem, solution, alternative)
        for field in ("delta_compute", "delta_communication", "delta_resharding"):
            assert math.isclose(getattr(mine, field), sum(getattr(r, field) for r in reasons),
                                rel_tol=1e-9, abs_tol=1e-15)
        if len(reasons) == 1:
            assert math.isclose(mine.delta_peak_memory, reasons[0].delta_peak_memory,
                                rel_tol=1e-9, abs_tol=1e-9)
        checked += 1
    return checked


def test_local_next_best_agrees_with_solver_explain(compiled):
    result, _ = compiled
    assert _check_against_solver_explain(result.state.problem, result.state.solution) > 10


def test_local_next_best_on_a_tight_budget():
    def s(name, compute, comm, memory):
        return Strategy(name, compute, comm, memory, (("all-reduce", "x", 1.0),) if comm else ())

    nodes = (
        Node("a", (s("R", 0, 0, 100), s("S", 0, 0, 50))),
        Node("b", (s("R", 4, 0, 80), s("S0", 1, 1, 40), s("S1", 1, 0.5, 40)), tie=1),
        Node("c", (s("R", 2, 0, 60), s("S0", 0.5, 0, 30), s("S1", 0.5, 0, 30)), tie=1),
        Node("d", (s("R", 1, 0, 10), s("S", 0.5, 0, 5))),
    )
    edges = (
        Edge(0, 1, ((0, 1, 1), (2, 0, 3))),
        Edge(1, 2, ((0, 1, 1), (1, 0, 1), (1, 1, 0))),
        Edge(2, 3, ((0, 1), (1, 0), (1, 0))),
    )
    points = (LivePoint((0, 1), 10), LivePoint((0, 1, 2), 0), LivePoint((2, 3), 5))
    problem = ShardingProblem(nodes, edges, points, memory_budget=200)
    problem.validate()
    for choice in ((1, 1, 1, 1), (1, 2, 2, 0), (0, 1, 1, 1), (1, 0, 0, 1)):
        _check_against_solver_explain(problem, Solution(choice))
    # Moving a (50 -> 100 bytes) at (1, 1, 1, 1) breaks the 120-byte budget.
    tight = ShardingProblem(nodes, edges, points, memory_budget=130)
    alt = decisions.DecisionIndex(tight, Solution((1, 1, 1, 1))).next_best(0)
    assert not alt.feasible and alt.peak_memory == 170
    text = decisions._reason("placing a", "P('x')", "P()", alt, 130, "communication",
                             "resharding")
    assert "P() would need 170 B > 130 B budget" in text


def test_explain_says_what_donating_the_state_would_save(compiled):
    """The fixture is exported without donation: its new parameters have buffers of their own
    beside the old ones, which explain counts and says how to avoid."""
    result, plan_dir = compiled
    plan = result.plan
    assert plan["donation"] == {"arguments": [], "aliases": [], "resharded_results": []}
    new_params = [r for r in plan["results"] if r["name"] != "result[0]"]
    data = json.loads(_run(plan_dir, "--format", "json").stdout)
    assert data["memory"]["donation"] == {
        "donated_arguments": 0, "in_place_results": 0, "in_place_bytes": 0.0,
        "donatable_results": len(new_params),
        "donatable_bytes": float(sum(r["bytes_per_device"] for r in new_params))}
    assert "donate_argnums" in _run(plan_dir).stdout


def test_explain_of_a_donated_step_counts_what_is_written_in_place(tmp_path):
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jax.numpy.sum(jax.numpy.tanh(x @ w)))(w)

    s = jax.ShapeDtypeStruct((256, 256), jax.numpy.float32)
    data = jax.export.export(jax.jit(step, donate_argnums=(0,)))(s, s).serialize()
    result = hloplan.compile(bytes(data), mesh="8", device="toy", output=str(tmp_path / "p"))
    assert result.plan["donation"]["aliases"] == [[0, 0]]
    summary = json.loads(_run(tmp_path / "p", "--format", "json").stdout)["memory"]["donation"]
    assert summary["in_place_results"] == 1 and summary["donatable_results"] == 0
    text = _run(tmp_path / "p").stdout
    assert "1 result is written into donated arguments' buffers" in text
    assert "donate_argnums" not in text
    # The shardings to paste into jax.jit donate what the export donated.
    source = _run(tmp_path / "p", "--format", "jax").stdout
    assert "out_shardings=out_shardings, donate_argnums=(0,))" in source


def test_loader_names_the_jax_a_plan_was_made_with(compiled, tmp_path, monkeypatch):
    import shutil

    from hloplan.emit import loader

    result, plan_dir = compiled
    assert result.plan["versions"]["jax"] == jax.__version__  # plan.json records its jax
    copy = tmp_path / "plan"
    shutil.copytree(plan_dir, copy)
    plan = json.loads((copy / "plan.json").read_text())
    plan["versions"]["jax"] = "99.0.0"
    (copy / "plan.json").write_text(json.dumps(plan))

    def refuse(data):
        raise ValueError("unsupported serialization version 99")

    monkeypatch.setattr(jax.export, "deserialize", refuse)
    with pytest.raises(loader.PlanLoadError, match=r"made with jax 99\.0\.0 and the running jax "
                       rf"is {jax.__version__}.*unsupported serialization version"):
        hloplan.load(copy)


@pytest.mark.parametrize("seed", range(3))
def test_local_next_best_counts_loop_accumulators(seed):
    """Problems whose nodes hold loop accumulators (test_liveness._problem): the local
    arithmetic prices them as evaluate does."""
    from test_liveness import _problem

    problem = _problem(seed)
    assert any(s.accumulators for n in problem.nodes for s in n.strategies)
    assert _check_against_solver_explain(problem, Solution((0,) * len(problem.nodes))) > 0


def test_local_next_best_prices_a_loop_reading_a_shared_reshard():
    """A loop reading its operand through another matmul's reshard holds no copy of its own
    (test_collective_matmul): DecisionIndex and compare price the copy a move of the value,
    the matmul or the loop makes or saves as evaluate does."""
    from test_collective_matmul import _reading_through_a_shared_reshard

    problem = _reading_through_a_shared_reshard()
    for choice in [(a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1)]:
        assert _check_against_solver_explain(problem, Solution(choice)) > 0
