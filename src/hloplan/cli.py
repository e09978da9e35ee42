"""Command line: `hloplan compile | run | opt`. No planning logic here: parse, call, report.

Exit codes: 0 ok; 1 diagnostics (unsupported program, infeasible plan); 2 usage, configuration or
I/O errors; 101 internal error (with a reproducer saved).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
import traceback
from pathlib import Path

import click

from hloplan.cli_common import MESH_HELP
from hloplan.cli_explain import explain_command
from hloplan.cli_help import COMPILE_GROUPS, GroupedCommand
from hloplan.diagnostics import (
    EXIT_DIAGNOSTICS,
    EXIT_INTERNAL,
    EXIT_USAGE,
    Diagnostic,
    HloplanError,
    UsageError,
)
from hloplan.graph import DONATE_CHOICES
from hloplan.mesh import MESH_VIEW_CHOICES, MeshSpec


def _read_input(path: str) -> tuple[bytes, str]:
    if path == "-":
        return sys.stdin.buffer.read(), "<stdin>"
    try:
        return Path(path).read_bytes(), path
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


def _emit_diagnostics(diags: list[Diagnostic], filename: str, fmt: str, quiet: bool) -> None:
    if fmt == "json":
        return
    for diag in diags:
        if quiet and diag.severity != "error":
            continue
        click.echo(diag.format(filename), err=True)


def _fail(exc: HloplanError, filename: str, fmt: str, extra: dict | None = None) -> None:
    if fmt == "json":
        payload = {"ok": False, "exit_code": exc.exit_code,
                   "diagnostics": [d.to_json() for d in exc.diagnostics]}
        payload.update(extra or {})
        click.echo(json.dumps(payload, indent=1, sort_keys=True))
    else:
        _emit_diagnostics(exc.diagnostics, filename, "text", False)
    sys.exit(exc.exit_code)


def _save_reproducer(directory: str | None, data: bytes, filename: str, argv: list[str],
                     error: str) -> str:
    target = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="hloplan-reproducer-"))
    target.mkdir(parents=True, exist_ok=True)
    (target / ("input" + Path(filename).suffix)).write_bytes(data)
    (target / "command.txt").write_text(shlex.join(argv) + "\n")
    (target / "error.txt").write_text(error)
    return str(target)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hloplan")
def main() -> None:
    """Automatic sharding of exported JAX programs.

    \b
    hloplan compile step.jaxexport --mesh 2x4 -o plan/   plan a program
    hloplan explain plan/                               what it chose, and why
    hloplan run plan/ --check                           run it against the original
    """


main.add_command(explain_command)


@main.command("compile", cls=GroupedCommand, groups=COMPILE_GROUPS,
              short_help="Plan a program for a device mesh and write the plan directory.")
@click.argument("input_path", metavar="INPUT")
@click.option("--mesh", required=True, help=MESH_HELP)
@click.option("-o", "--output", type=click.Path(file_okay=False),
              help="plan directory to write (without it: the annotated MLIR to stdout)")
@click.option("--device", default="h100", show_default=True,
              help="hardware cost model: a short name (h100, tpu-v5e, cpu, ...) or a TOML file")
@click.option("--memory-budget", default=None, help="bytes per device, e.g. 16GiB (default: the device's memory)")
@click.option("--time-limit", default=60.0, show_default=True, type=float, help="solver time limit in seconds")
@click.option("--solver", type=click.Choice(["auto", "highs", "cbc"]), default="auto", show_default=True,
              help="ILP solver ('auto': HiGHS when installed, else CBC)")
@click.option("--hosts", type=int, default=None, help="number of hosts the mesh spans (slow links between them)")
@click.option("--decompose", type=click.Choice(["auto", "always", "never"]), default="auto",
              show_default=True,
              help="plan meshes of 3+ axes on 2-axis views, one pair of axes at a time ('auto': "
                   "when the whole ILP would be too big)")
@click.option("--gap", type=float, default=0.01, show_default=True,
              help="stop once the plan is proven within this fraction of the optimum (0: prove it)")
@click.option("--mesh-views", type=click.Choice(MESH_VIEW_CHOICES), default="auto",
              show_default=True,
              help="also plan the mesh with an axis split in two (the same devices; 'auto': a "
                   "one-axis mesh such as 8 as 2x4 and 4x2) and keep the fastest plan")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="json: the summary and diagnostics as JSON on stdout")
@click.option("--print-after", "print_after", multiple=True, metavar="PASS",
              help="print the module after PASS to stderr, or what an analysis pass produced (the "
                   "graph, the sharding problem, the solution) (repeatable; 'all' for every pass)")
@click.option("--time-passes", is_flag=True, help="print the wall time of each step to stderr")
@click.option("--reproducer", "reproducer", default=None, metavar="DIR",
              help="save input, options and the sharding problem to DIR for a bug report")
@click.option("--stages", default=None, metavar="auto|N",
              help="pipeline stages, each on a submesh chosen with them ('auto': only if it beats one stage)")
@click.option("--microbatches", default=None, metavar="auto|M", help="microbatches per step")
@click.option("--schedule", type=click.Choice(["gpipe", "1f1b"]), default="1f1b", show_default=True,
              help="pipeline schedule")
@click.option("--batch-arg", "batch_args", multiple=True, metavar="NAME",
              help="an input that carries the batch (repeatable; default: found automatically)")
@click.option("--pass-option", "pass_options", multiple=True, metavar="PASS.FIELD=VALUE",
              help="set a pass option (repeatable), e.g. tie-repeated-layers.compare_untied=true "
                   "to also solve the untied ILP and report the price of tying")
@click.option("--verify-memory", is_flag=True,
              help="compile the plan with XLA (simulated CPU devices) and plan again while its "
                   "allocation per device is over the budget")
@click.option("--select", "select", type=click.Choice(["estimate", "compiled"]),
              default="estimate", show_default=True,
              help="how the plan is kept: the cost model's fastest, or 'compiled': the model's "
                   "plan, data parallel, FSDP and (TPU device models) the plan counting "
                   "collective-matmul loops' sends in full, compiled by the target compiler "
                   "(libtpu for a TPU device model) and the lowest compiled score kept")
@click.option("--donate", type=click.Choice(DONATE_CHOICES), default="export",
              show_default=True,
              help="arguments whose buffers the results reuse: those the export donates, also "
                   "the state the step updates in place, or none (extract-graph.donate)")
@click.option("-q", "--quiet", is_flag=True, help="print errors only")
def compile_command(input_path, mesh, output, device, memory_budget, time_limit, solver, hosts,
                    decompose, gap, mesh_views, fmt, print_after, time_passes, reproducer, stages,
                    microbatches, schedule, batch_args, pass_options, verify_memory, select,
                    donate, quiet):
    """Plan INPUT (a serialized jax.export.Exported, StableHLO text, MLIR bytecode or a portable
    artifact; '-' for stdin) for a device mesh and write the plan directory (-o DIR).

    Without -o, nothing is written: the annotated StableHLO (MLIR) goes to stdout and the
    summary to stderr.

    \b
    Example:
      hloplan compile step.jaxexport --mesh 2x4 --device h100 -o plan/
    """
    from hloplan import pass_dump
    from hloplan.compiler import compile_bytes, make_options
    from hloplan.passmanager import PASS_NAMES, pass_pipeline

    filename = input_path
    data = b""
    try:
        data, filename = _read_input(input_path)
        unknown = [p for p in print_after if p != "all" and p not in PASS_NAMES]
        if unknown:
            raise UsageError(f"--print-after: unknown pass {unknown[0]!r}",
                             notes=("passes: " + ", ".join(PASS_NAMES),))
        options = make_options(mesh, device=device, memory_budget=memory_budget,
                               time_limit=time_limit, solver=solver, hosts=hosts,
                               decompose=decompose, gap=gap, verify_memory=verify_memory,
                               mesh_views=mesh_views, select=select)

        progress = _Progress(enabled=fmt == "text" and not quiet and sys.stderr.isatty())

        def after_pass(name, state):
            progress.step(name, state)
            if "all" in print_after or name in print_after:
                click.echo(pass_dump.after_pass(name, state), err=True)

        passes = None
        if donate != "export":
            pass_options = (f"extract-graph.donate={donate}", *pass_options)
        if pass_options:
            passes = pass_pipeline(pass_options)
        pipeline = _pipeline_options(stages, microbatches, schedule, batch_args)
        if output is not None:  # refuse an unusable -o before planning, not after
            from hloplan.emit.artifact import check_output

            check_output(output)
        with progress:
            result = compile_bytes(data, filename, options, after_pass=after_pass,
                                   pipeline=pipeline, passes=passes)
        if reproducer:
            try:
                _write_problem_reproducer(reproducer, data, filename, result.state)
            except OSError as exc:
                raise UsageError(f"--reproducer {reproducer}: {exc.strerror or exc}") from None
        if output is not None:
            result.write(output)
    except HloplanError as exc:
        _fail(exc, filename, fmt)
        return
    except Exception:  # an internal error: say where the reproducer went
        error = traceback.format_exc()
        try:
            saved = _save_reproducer(reproducer, data, filename, sys.argv, error)
        except OSError:  # --reproducer DIR unwritable: a directory of our own
            saved = _save_reproducer(None, data, filename, sys.argv, error)
        click.echo(f"{filename}: error: internal compiler error: "
                   f"{error.strip().splitlines()[-1]}", err=True)
        click.echo(f"{filename}: note: reproducer saved to {saved}; please report it", err=True)
        sys.exit(EXIT_INTERNAL)
    state = result.state
    _emit_diagnostics(state.log.entries, filename, fmt, quiet)
    if time_passes:
        for name, seconds in result.timings.items():
            click.echo(f"  {seconds * 1e3:10.2f} ms  {name}", err=True)
    plan = result.plan
    if fmt == "json":
        click.echo(json.dumps({"ok": True, "output": output, "mesh": plan["mesh"],
                               "mesh_views": plan.get("mesh_views"), "estimate": plan["estimate"],
                               "solver": plan["solver"], "arguments": plan["arguments"],
                               "results": plan["results"], "diagnostics": plan["diagnostics"],
                               "memory_check": plan.get("memory_check"),
                               "selection": plan.get("selection")},
                              indent=1, sort_keys=True))
    else:
        if not quiet:
            _summary(plan, output)
        if not output:
            click.echo(result.files["module.mlir"].decode(), nl=False)


class _Progress:
    """A one-line live status on a terminal (never in JSON output or CI logs)."""

    NEXT = {"inline-calls": "analysing", "extract-graph": "building the sharding problem",
            "build-sharding-problem": "solving", "solve-sharding": "annotating",
            "propagate-sharding": "emitting"}

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.status = None

    def __enter__(self):
        if self.enabled:
            from rich.console import Console

            self.status = Console(stderr=True).status("parsing")
            self.status.__enter__()
        return self

    def step(self, name: str, state) -> None:
        if self.status is None:
            return
        detail = ""
        if name == "build-sharding-problem":
            detail = f" ({state.facts.get('nodes', 0)} decisions, {state.facts.get('edges', 0)} edges)"
        if name == "solve-sharding" and state.stats is not None:
            detail = f" (solver {state.stats.status}, gap {state.stats.gap:.2%})"
        self.status.update(f"{self.NEXT.get(name, name)}{detail}")

    def __exit__(self, *exc):
        if self.status is not None:
            self.status.__exit__(*exc)
        return False


def _pipeline_options(stages, microbatches, schedule, batch_args):
    from hloplan.pipeline_parallel import PipelineOptions

    if stages is None and microbatches is None and not batch_args:
        return None

    def count(text, flag):
        if text is None or text == "auto":
            return None
        if not text.isdigit() or int(text) < 1:
            raise UsageError(f"{flag} must be 'auto' or a positive integer, not {text!r}")
        return int(text)

    return PipelineOptions(stages=count(stages, "--stages"),
                           microbatches=count(microbatches, "--microbatches"),
                           schedule=schedule, batch_args=tuple(batch_args))


def _summary(plan: dict, output: str | None) -> None:
    from hloplan.units import format_bytes, format_seconds, stages_text

    est, solver = plan["estimate"], plan["solver"]
    mesh = str(MeshSpec(plan["mesh"]["axis_names"], plan["mesh"]["axis_sizes"]))
    view_of = plan["mesh"].get("view_of")
    if view_of:
        mesh += f" (a view of {MeshSpec(view_of['axis_names'], view_of['axis_sizes'])})"
    pipe = plan.get("pipeline")
    pipelined = bool(pipe and pipe.get("tasks"))
    lines = [
        f"{'single-program plan' if pipelined else 'planned'} for mesh {mesh} on "
        f"{plan['device_model']['name']}: estimated step "
        f"{format_seconds(est['step_time_s'])} (compute {format_seconds(est['compute_s'])}, "
        f"communication {format_seconds(est['communication_s'] + est['resharding_s'])}), "
        f"peak {format_bytes(est['peak_memory_bytes'])} per device",
        f"solver {solver['name']}: {solver['status']}, gap "
        f"{solver['gap']:.2%}{'' if solver['gap'] != float('inf') else ' (no bound)'}, "
        f"{solver['variables']} variables, {solver['constraints']} constraints",
    ]
    if plan.get("rematerialized"):
        lines[0] += (f", recomputing {plan['rematerialized']['values']} activations after the "
                     "forward pass")
    budget = plan.get("memory_budget_bytes")
    if pipelined and budget is not None and est["peak_memory_bytes"] > budget:
        lines[0] += f", over the budget of {format_bytes(budget)}"
    if pipelined:
        est = pipe["estimate"]
        lines.append(f"pipeline: {stages_text(pipe['stages'], pipe['microbatches'])} "
                     f"({pipe['schedule']}), estimated step {format_seconds(est['step_time_s'])}, "
                     f"peak {format_bytes(max(est['memory_per_stage_bytes']))} per device, "
                     f"bubble {est['bubble_fraction']:.0%}")
    elif pipe:
        why = pipe.get("search", {}).get("single_stage_only")
        lines.append(f"pipeline: none ({why or 'one stage is estimated fastest'})")
    check = plan.get("memory_check")
    if check:
        last = check["tries"][check["kept"]]
        lines.append(f"memory checked with XLA ({check['platform']}): compiles to "
                     f"{format_bytes(last['peak_bytes'])} per device (estimated "
                     f"{format_bytes(last['estimated_bytes'])})"
                     + (f", planned with {format_bytes(last['reserve_bytes'])} kept free "
                        f"(the fastest of {len(check['tries'])} plans tried that fits)"
                        if len(check["tries"]) > 1 else ""))
    if output:
        lines.append(f"wrote {output.rstrip('/')}/")
    for line in lines:
        click.echo(line, err=True)


def _write_problem_reproducer(directory: str, data: bytes, filename: str, state) -> None:
    import dataclasses

    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    (target / ("input" + (Path(filename).suffix or ".bin"))).write_bytes(data)
    (target / "command.txt").write_text(shlex.join(sys.argv) + "\n")
    problem = dataclasses.asdict(state.problem)
    (target / "problem.json").write_text(json.dumps(problem, default=str) + "\n")


@main.command("run")
@click.argument("plan_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--check", is_flag=True, help="compare with the single-device program on random inputs")
@click.option("--inputs", type=click.Path(exists=True, dir_okay=False), default=None,
              help=".npz with arg0..argN (flat leaves) to use instead of random inputs")
@click.option("--seed", default=0, show_default=True)
@click.option("--rtol", default=1e-4, show_default=True)
@click.option("--atol", default=1e-5, show_default=True)
@click.option("--processes", type=click.IntRange(min=1), default=None, metavar="N",
              help="run as a jax.distributed job of N local CPU processes on loopback "
                   "(mesh devices / N simulated devices each)")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=300.0,
              show_default=True, help="with --processes: seconds before all processes are stopped")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def run_command(plan_dir, check, inputs, seed, rtol, atol, processes, timeout, fmt):
    """Run the plan in PLAN_DIR on the visible devices (simulated CPU devices are fine), or with
    --processes N across N local processes."""
    from hloplan.check import check_plan, format_report

    try:
        if processes is not None:
            from hloplan.multiprocess import run_plan_processes

            report = run_plan_processes(plan_dir, processes, inputs=inputs, seed=seed, rtol=rtol,
                                        atol=atol, compare=check, timeout=timeout)
        else:
            report = check_plan(plan_dir, inputs=inputs, seed=seed, rtol=rtol, atol=atol,
                                compare=check)
    except HloplanError as exc:
        _fail(exc, plan_dir, fmt)
        return
    _echo_report(report, fmt, format_report)
    if check and not report["match"]:
        sys.exit(EXIT_DIAGNOSTICS)


def _echo_report(report: dict, fmt: str, format_text) -> None:
    """A command's report on stdout: JSON, or format_text's rendering."""
    click.echo(json.dumps(report, indent=1, sort_keys=True) if fmt == "json"
               else format_text(report))


@main.command("opt", hidden=True)  # a developer's tool: golden IR tests run passes with it
@click.argument("input_path", metavar="INPUT")
@click.option("-p", "--passes", "pass_list", required=True,
              help="comma-separated passes to run, e.g. inline-calls,extract-graph")
@click.option("--mesh", default="1", help=MESH_HELP)
@click.option("--device", default="h100", show_default=True)
@click.option("--memory-budget", default=None)
@click.option("--pass-option", "pass_options", multiple=True, metavar="PASS.FIELD=VALUE",
              help="set a pass option, e.g. tie-repeated-layers.min_decisions=0 (repeatable)")
def opt_command(input_path, pass_list, mesh, device, memory_budget, pass_options):
    """Run passes on INPUT and print the module (for golden IR tests)."""
    from hloplan import ir
    from hloplan.compiler import make_options
    from hloplan.passmanager import pass_pipeline, run_passes, with_pass_options

    filename = input_path
    try:
        data, filename = _read_input(input_path)
        by_name = {p.name: p for p in pass_pipeline()}
        names = [n.strip() for n in pass_list.split(",") if n.strip()]
        for name in names:
            if name not in by_name:
                raise UsageError(f"unknown pass {name!r}", notes=("passes: " + ", ".join(by_name),))
        by_name = with_pass_options(by_name, pass_options)
        options = make_options(mesh, device=device, memory_budget=memory_budget)
        program = ir.load_program(data, filename)
        state = run_passes(program, options, [by_name[n] for n in names])
    except HloplanError as exc:
        _fail(exc, filename, "text")
        return
    _emit_diagnostics(state.log.entries, filename, "text", False)
    click.echo(ir.module_text(program.module, debug_info=False), nl=False)


@main.command("verify")
@click.argument("plan_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--compiler", type=click.Choice(["auto", "cpu", "tpu"]), default="auto",
              show_default=True,
              help="XLA compiler to check with: tpu (libtpu, for the TPU topology of the plan's "
                   "mesh, no TPU needed), cpu (simulated devices); auto: tpu for a TPU plan "
                   "when libtpu is installed")
@click.option("--topology", default=None, metavar="KIND:AxB",
              help="TPU topology to compile for, e.g. v5e:2x4 (default: from the device model "
                   "and the mesh's device count)")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=1800.0,
              show_default=True, help="seconds before the compile is given up")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def verify_command(plan_dir, compiler, topology, timeout, fmt):
    """Compile the plan in PLAN_DIR with XLA (no run) and print predicted vs compiled
    collectives per kind and mesh axes, and the peak memory per device."""
    from hloplan.verify import format_verify_report, verify_plan

    try:
        report = verify_plan(plan_dir, compiler=compiler, topology=topology, timeout=timeout)
    except HloplanError as exc:
        _fail(exc, plan_dir, fmt)
        return
    _echo_report(report, fmt, format_verify_report)


@main.command("calibrate")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="device model TOML to write (for --device FILE)")
@click.option("--base", default=None,
              help="device model (name or TOML) for what is not measured (default: the shipped "
                   "model of the platform jax runs on)")
@click.option("--name", default=None, help="model name to write (default: calibrated-BASE)")
@click.option("--quick", is_flag=True, help="tiny sizes: seconds, not representative")
@click.option("--from-file", "from_file", default=None,
              type=click.Path(exists=True, dir_okay=False),
              help="no measuring: write the model again from the measurements recorded in this "
                   "calibrated model (its [calibration], [matmul] and [conv] tables) against "
                   "the current base model")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def calibrate_command(output, base, name, quick, from_file, fmt):
    """Measure the accelerator jax sees (matmul FLOP/s per dtype and size, HBM bandwidth,
    program overhead, all-reduce bandwidth and latency across its devices) and write a device
    model TOML."""
    from hloplan.calibrate import calibrate, measurements_of
    from hloplan.cost_models import DeviceModelError, load_device_model

    try:
        recorded = None
        if from_file is not None:
            try:
                recorded = measurements_of(Path(from_file).read_text())
            except ValueError as exc:  # TOMLDecodeError is one
                raise DeviceModelError(f"{from_file}: {exc}") from exc
        base_file = None
        if base is not None:
            model = load_device_model(base)
            base_file = model.source if not model.source.startswith("package:") else None
            if base_file is None:
                from importlib import resources

                base_file = resources.files("hloplan.cost_models").joinpath(
                    model.source.removeprefix("package:"))
        measured = calibrate(output, base_file=base_file, name=name, quick=quick,
                             measurements=recorded)
        load_device_model(output)  # what was written loads
    except DeviceModelError as exc:
        _fail(UsageError(str(exc)), output, fmt)
        return
    except OSError as exc:
        _fail(UsageError(f"cannot write {output}: {exc.strerror or exc}"), output, fmt)
        return
    if fmt == "json":
        click.echo(json.dumps({"ok": True, "output": output, "measured": measured},
                              indent=1, sort_keys=True))
        return
    from hloplan.units import format_seconds

    click.echo(f"{measured['devices']} x {measured['device_kind']} ({measured['platform']}): "
               f"matmul f32 {measured['matmul_f32_large'] / 1e12:.3g} TFLOP/s, bf16 "
               f"{measured['matmul_bf16_large'] / 1e12:.3g} TFLOP/s (n="
               f"{measured['matmul_large_n']}); HBM {measured['hbm_bandwidth'] / 1e9:.3g} GB/s; "
               f"program overhead {format_seconds(measured['program_overhead'])}"
               + (f"; all-reduce {measured['allreduce_bandwidth'] / 1e9:.3g} GB/s, "
                  f"{format_seconds(measured['allreduce_latency'])} per step"
                  if "allreduce_bandwidth" in measured else ""))
    click.echo(f"wrote {output}")


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

__all__ = ["main", "EXIT_USAGE"]
