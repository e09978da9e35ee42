"""`hloplan explain PLAN_DIR` / `hloplan explain INPUT --mesh M`: what a plan decided and why.

Exit codes as for the other commands: 0 ok; 1 diagnostics (INPUT cannot be planned); 2 a missing
or invalid plan directory, or another usage or I/O error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from hloplan.cli_common import MESH_HELP
from hloplan.diagnostics import HloplanError, UsageError, escape_strings
from hloplan.mesh import MESH_VIEW_CHOICES


def _error(exc: HloplanError, where: str, fmt: str) -> None:
    if fmt == "json":
        click.echo(json.dumps({"ok": False, "exit_code": exc.exit_code,
                               "diagnostics": [d.to_json() for d in exc.diagnostics]},
                              indent=1, sort_keys=True))
    for diag in exc.diagnostics:
        click.echo(diag.format(where), err=True)
    sys.exit(exc.exit_code)


def _console():
    from rich.console import Console

    interactive = sys.stdout.isatty()
    return Console(stderr=False, width=None if interactive else 120, highlight=False,
                   soft_wrap=False)


def _plan_input(target: str, mesh: str, device: str, memory_budget, time_limit: float,
                hosts: int | None, mesh_views: str = "auto"):
    """Plan INPUT in memory: (plan, serialized sharded Exported, diagnostics)."""
    from hloplan.compiler import compile_bytes, make_options

    if target == "-":
        data, filename = sys.stdin.buffer.read(), "<stdin>"
    else:
        try:
            data, filename = Path(target).read_bytes(), target
        except OSError as exc:
            raise UsageError(f"cannot read {target}: {exc.strerror}") from None
    options = make_options(mesh, device=device, memory_budget=memory_budget,
                           time_limit=time_limit, hosts=hosts, mesh_views=mesh_views)
    result = compile_bytes(data, filename, options)
    return (escape_strings(result.plan), result.files["sharded.jaxexport"],
            result.state.log.entries)


@click.command("explain")
@click.argument("target", metavar="PLAN_DIR|INPUT")
@click.option("--mesh", default=None, help=MESH_HELP + "; plans INPUT in memory")
@click.option("--device", default="h100", show_default=True,
              help="hardware cost model for INPUT: a short name (h100, tpu-v5e, cpu, ...) or a TOML file")
@click.option("--memory-budget", default=None,
              help="bytes per device for INPUT, e.g. 16GiB (default: the device's memory)")
@click.option("--time-limit", default=60.0, show_default=True, type=float,
              help="solver time limit in seconds for INPUT")
@click.option("--hosts", type=int, default=None, help="number of hosts the mesh spans (INPUT)")
@click.option("--mesh-views", type=click.Choice(MESH_VIEW_CHOICES), default="auto",
              show_default=True, help="views of the mesh also planned for INPUT (as compile)")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "jax"]), default="text",
              show_default=True,
              help="text: a summary, tables and bars; json: machine-readable; jax: Python code "
                   "that builds the mesh and the NamedShardings and jits the function")
@click.option("-v", "--verbose", "--full", "verbose", is_flag=True,
              help="every argument, result and decision, the device model and solver details")
@click.option("--svg", "svg_path", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="also write a picture of the plan as SVG: the mesh with the batch and the "
                   "largest tensors laid out on it, pipeline stages, step time and memory")
@click.option("--png", "png_path", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="the same picture as PNG")
@click.option("--top", default=None, type=click.IntRange(1, None),
              help="how many of the costliest ops to list [default: 5; 10 with --verbose]")
def explain_command(target, mesh, device, memory_budget, time_limit, hosts, mesh_views, fmt,
                    verbose, svg_path, png_path, top):
    """Explain a plan: shardings, estimated step time and memory, the costliest ops, and why the
    planner chose what it chose.

    PLAN_DIR is a directory written by `hloplan compile -o`; INPUT (with --mesh) is a program to
    plan in memory first, as `hloplan compile` would.
    """
    from hloplan import explain_report as report

    where = target
    diagnostics = []
    exported_source = None
    try:
        path = Path(target)
        if target != "-" and path.is_file() and path.name == report.PLAN_FILE and mesh is None:
            path = path.parent  # plan.json itself: explain its directory
            where = str(path)
        if target != "-" and path.is_dir():
            if mesh is not None:
                raise UsageError("this is a plan directory; --mesh only applies to an INPUT "
                                 "program", notes=("drop --mesh, or pass the program",))
            plan = report.load_plan_dir(path)
            exported_source = path
        elif target == "-" or path.is_file():
            if mesh is None:
                raise report.PlanDirError(
                    "not a plan directory; to plan an input program in memory, pass --mesh",
                    target, notes=("e.g. hloplan explain step.jaxexport --mesh 2x4",))
            plan, exported_source, diagnostics = _plan_input(target, mesh, device, memory_budget,
                                                             time_limit, hosts, mesh_views)
        else:
            raise report.PlanDirError("no such file or directory", target)
        if fmt != "json":
            for diag in diagnostics:
                click.echo(diag.format(where), err=True)
        if fmt == "json":
            click.echo(json.dumps(report.summary(plan, top or 10), indent=1, sort_keys=True))
        elif fmt == "jax":
            reference = None
            if isinstance(exported_source, Path) and (exported_source / "reference.jaxexport").is_file():
                reference = (exported_source / "reference.jaxexport").resolve()
            click.echo(report.jax_source(plan, report.load_exported(exported_source), reference),
                       nl=False)
        else:
            report.render_text(plan, _console(), top, verbose=verbose)
        for picture_path, kind in ((svg_path, "svg"), (png_path, "png")):
            if not picture_path:
                continue
            from hloplan import explain_picture

            try:
                explain_picture.write(plan, picture_path, kind)
            except OSError as exc:
                raise UsageError(f"cannot write {picture_path}: {exc.strerror}") from None
            if fmt == "text":
                click.echo(f"wrote {picture_path}", err=True)
    except HloplanError as exc:
        _error(exc, where, fmt)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, ArithmeticError) as exc:
        if not isinstance(exported_source, Path):  # planned in memory: an internal error
            raise
        # plan.json edited by hand past what load_plan_dir checks: a usage error, not a crash
        _error(report.PlanDirError(f"{report.PLAN_FILE} holds a field explain cannot show "
                                   f"({type(exc).__name__}: {exc}); compile the plan again",
                                   where), where, fmt)
