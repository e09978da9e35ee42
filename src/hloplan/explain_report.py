"""`hloplan explain`: what a plan decided, what it is estimated to cost, and why.

Everything here reads a plan as plan.json writes it (see hloplan.plan.build_plan), so a plan
directory and a plan made in memory render the same way:

- `render_text`: rich tables (mesh, device model, arguments and results with their PartitionSpec,
  step-time split, collectives, memory against the budget, the costliest ops, the decisions and
  their reasons) and horizontal bars;
- `summary`: the same as plain JSON data;
- `bars_svg`: the bars as a standalone SVG picture;
- `jax_source`: Python source of `in_shardings` / `out_shardings` pytrees of PartitionSpec that
  match the original function's arguments and results;
- `in_shardings(plan_dir, mesh)` / `out_shardings(plan_dir, mesh)`: the same as NamedShardings.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from hloplan.decisions import partition_spec_text
from hloplan.diagnostics import UsageError
from hloplan.units import format_bytes, format_seconds, stages_text

__all__ = [
    "Chart",
    "PlanDirError",
    "bars_svg",
    "charts",
    "in_shardings",
    "jax_source",
    "load_exported",
    "load_plan_dir",
    "memory_breakdown",
    "out_shardings",
    "render_text",
    "step_breakdown",
    "summary",
    "top_ops",
]

PLAN_FILE = "plan.json"
EXPORTED_FILE = "sharded.jaxexport"
_REQUIRED_KEYS = ("format", "mesh", "device_model", "arguments", "results", "estimate", "ops")
_SUPPORTED_FORMATS = (1,)


class PlanDirError(UsageError):
    """A path that is not a readable plan directory (exit code 2). The message does not repeat
    the path: the CLI prints it as `PATH: error: message`; str() of the error names it."""

    def __init__(self, message: str, path: str | Path | None = None, notes: tuple[str, ...] = ()):
        super().__init__(message, notes=notes)
        self.path = None if path is None else str(path)

    def __str__(self) -> str:
        return "\n".join(d.format(self.path or "<plan>") for d in self.diagnostics)


# -- loading -------------------------------------------------------------------------------------


def load_plan_dir(plan_dir: str | Path) -> dict:
    """plan.json of `plan_dir`, checked to be a plan this module can render."""
    directory = Path(plan_dir)
    if not directory.exists():
        raise PlanDirError("no such file or directory", directory)
    if not directory.is_dir():
        raise PlanDirError("not a plan directory", directory)
    path = directory / PLAN_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PlanDirError(f"not an hloplan plan directory (no {PLAN_FILE})", directory,
                           notes=("make one with `hloplan compile INPUT --mesh M -o DIR`",)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanDirError(f"cannot read {PLAN_FILE}: {getattr(exc, 'strerror', None) or exc}",
                           directory) from None
    try:
        plan = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise PlanDirError(f"{PLAN_FILE} is not valid JSON: {exc}", directory) from None
    check_plan(plan, directory)
    from hloplan.diagnostics import escape_strings
    from hloplan.emit.loader import PlanLoadError, check_plan_fields, verify_files

    try:  # the fields run reads, and the artifacts against their digests
        check_plan_fields(plan, path)
        verify_files(plan, directory)
    except PlanLoadError as exc:
        raise PlanDirError(str(exc), directory) from None
    return escape_strings(plan)


def check_plan(plan: object, directory: str | Path | None = None) -> None:
    """Raise PlanDirError unless `plan` looks like a plan.json this module can render."""
    if not isinstance(plan, dict):
        raise PlanDirError(f"{PLAN_FILE} does not hold a plan (expected a JSON object)", directory)
    missing = [key for key in _REQUIRED_KEYS if key not in plan]
    if missing:
        raise PlanDirError(f"{PLAN_FILE} is not an hloplan plan: missing {', '.join(missing)}",
                           directory)
    if plan["format"] not in _SUPPORTED_FORMATS:
        raise PlanDirError(f"{PLAN_FILE} has plan format {plan['format']!r}; this hloplan reads "
                           f"format {', '.join(map(str, _SUPPORTED_FORMATS))}", directory,
                           notes=("recompile the plan with this version of hloplan",))


def load_exported(source: str | Path | bytes | bytearray):
    """The sharded Exported of a plan directory (or its serialized bytes)."""
    from jax import export

    if isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    else:
        path = Path(source) / EXPORTED_FILE
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise PlanDirError(f"cannot read {EXPORTED_FILE}: {exc.strerror}", source) from None
    try:
        return export.deserialize(bytearray(data))
    except Exception as exc:  # a truncated or foreign file: say which
        where = None if isinstance(source, (bytes, bytearray)) else source
        raise PlanDirError(f"{EXPORTED_FILE} is not a serialized jax.export.Exported: {exc}",
                           where) from None


# -- numbers the views share ---------------------------------------------------------------------

_COLLECTIVE_IN_NAME = re.compile(r"\+ ([a-z][a-z-]*)\(([^)]*)\)")


def _budget(plan: dict) -> float | None:
    budget = plan.get("memory_budget_bytes")
    if budget is None:
        budget = plan["device_model"].get("memory_bytes")
    return float(budget) if budget else None


def step_breakdown(plan: dict) -> list[tuple[str, float]]:
    """The estimated step time split: compute, each collective the ops issue, resharding.

    plan.json gives op communication per op but not per collective; the collectives an op's
    strategy issues are named in the strategy ("... + all-reduce(x) <- ..."), so each op's
    communication is charged to those (evenly when there are several), and each merged
    collective's first launch (estimate "launches") to its collective.
    """
    est = plan["estimate"]
    parts: dict[str, float] = {}
    for op in plan["ops"]:
        seconds = op.get("communication_s") or 0.0
        if seconds <= 0:
            continue
        kinds = [f"{k}({a})" for k, a in _COLLECTIVE_IN_NAME.findall(op.get("strategy", ""))]
        for kind in kinds or ["other communication"]:
            parts[kind] = parts.get(kind, 0.0) + seconds / max(len(kinds), 1)
    for launch in est.get("launches", []):  # a merged collective's first launch
        kind = launch["collective"].split(" x")[0]
        parts[kind] = parts.get(kind, 0.0) + launch["seconds"]
    communication = est.get("communication_s", 0.0)
    if not parts and communication > 0:
        parts["communication"] = communication
    rows = [("compute", est.get("compute_s", 0.0))]
    rows += sorted(parts.items())
    rows.append(("resharding", est.get("resharding_s", 0.0)))
    return rows


_HELD_NAME_WIDTH = 60


def _held_name(entry: dict) -> str:
    """A value held at the peak, as the memory chart names it: op, source line, and what of
    it is held (plan.json estimate.peak)."""
    where = entry.get("location") or ""
    where = f" ({where.rsplit('/', 1)[-1]})" if where else ""
    name = f"{entry['id']} {entry['op'].split('.', 1)[-1]}{where}"
    if "copy_of" in entry:
        name = f"{name}: copy of {entry['copy_of']}"
    elif entry["held"] == "made":
        name = f"{name}: while made"
    return name if len(name) <= _HELD_NAME_WIDTH else name[:_HELD_NAME_WIDTH - 1] + "…"


def memory_breakdown(plan: dict, largest: int = 5) -> dict:
    """Peak bytes per device, the budget, and what the peak holds: the arguments (the `largest`
    by bytes per device one by one), the `largest` other values held there (the estimate's
    `peak`, from plans that have it) and the rest."""
    est = plan["estimate"]
    peak = float(est.get("peak_memory_bytes", 0))
    args = sorted(((a["bytes_per_device"], a["name"]) for a in plan["arguments"]),
                  key=lambda item: (-item[0], item[1]))
    total_args = float(sum(size for size, _ in args))
    parts = [(name, float(size)) for size, name in args[:largest]]
    rest = sum(size for size, _ in args[largest:])
    if rest:
        parts.append((f"{len(args) - largest} other arguments", float(rest)))
    held = [e for e in (est.get("peak") or {}).get("largest", []) if e["op"] != "arg"]
    listed = 0.0
    for entry in held[:largest]:
        parts.append((_held_name(entry), float(entry["bytes"])))
        listed += entry["bytes"]
    others = "other activations and temporaries" if listed else "activations and temporaries"
    parts.append((others, max(peak - total_args - listed, 0.0)))
    budget = _budget(plan)
    return {"peak_bytes": peak, "budget_bytes": budget,
            "fraction_of_budget": peak / budget if budget else None,
            "arguments_bytes": total_args, "parts": parts,
            "after": (est.get("peak") or {}).get("after")}


def donation(plan: dict) -> dict:
    """What the export donates (plan.json `donation`) and what donating more would save:
    results of an argument's shape, dtype and layout (a state's next value) that are not
    written into a donated argument have buffers of their own, which XLA allocates for the
    whole program, beside the arguments'."""
    given = plan.get("donation") or {}
    donated = set(given.get("arguments", []))
    in_place = {result for _, result in given.get("aliases", [])}

    def key(entry):
        return tuple(entry["shape"]), entry["dtype"], _spec_text(entry["spec"])

    free: dict = {}
    for position, argument in enumerate(plan["arguments"]):
        if position not in donated:
            free[key(argument)] = free.get(key(argument), 0) + 1
    donatable = []
    for index, result in enumerate(plan["results"]):
        if index not in in_place and free.get(key(result)):
            free[key(result)] -= 1
            donatable.append(index)
    results = plan["results"]
    return {"donated_arguments": len(donated), "in_place_results": len(in_place),
            "in_place_bytes": float(sum(results[k]["bytes_per_device"] for k in in_place)),
            "donatable_results": len(donatable),
            "donatable_bytes": float(sum(results[k]["bytes_per_device"] for k in donatable))}


def donation_line(plan: dict) -> str | None:
    """One line on donation for the memory section of `hloplan explain`, if it applies."""
    given = plan.get("donation") or {}
    if given.get("loader") and given.get("arguments"):
        return (f"the export donates {len(given['arguments'])} arguments: the pipeline loader "
                "hands them to the once-per-step tasks that read them last (the estimate "
                "counts those tasks' results in buffers of their own)")
    found = donation(plan)
    count = found["donatable_results"]
    if count and found["donatable_bytes"]:
        return (f"{count} result{'s' if count != 1 else ''} "
                f"({format_bytes(found['donatable_bytes'])} per device) "
                f"{'have buffers of their own' if count != 1 else 'has a buffer of its own'} "
                "beside arguments of their shape and layout: export the step with "
                "jax.jit(..., donate_argnums=...) to write them into those arguments' buffers")
    count = found["in_place_results"]
    if count:
        return (f"{count} result{'s are' if count != 1 else ' is'} written into donated "
                f"arguments' buffers ({format_bytes(found['in_place_bytes'])} per device)")
    return None


def _op_collectives(op: dict) -> list[str]:
    kinds = [f"{k}({a})" for k, a in _COLLECTIVE_IN_NAME.findall(op.get("strategy", ""))]
    if op.get("resharding_in_s"):
        kinds.append("resharding in")
    return kinds


def _op_total(op: dict) -> float:
    return (op.get("compute_s") or 0.0) + (op.get("communication_s") or 0.0) + (
        op.get("resharding_in_s") or 0.0)


def top_ops(plan: dict, count: int = 10) -> list[dict]:
    """The `count` ops with the largest estimated time (compute + communication + resharding)."""
    ranked = sorted(plan["ops"], key=lambda op: (-_op_total(op), _op_index(op["id"])))
    out = []
    for op in ranked[:count]:
        if _op_total(op) <= 0:
            break
        out.append({**op, "total_s": _op_total(op), "collectives": _op_collectives(op),
                    "where": _short_location(op.get("location"))})
    return out


def _op_index(op_id: str) -> int:
    try:
        return int(str(op_id).lstrip("%"))
    except ValueError:
        return 0


def _short_location(location: str | None) -> str | None:
    """'file.py:12:5' -> 'file.py:12'."""
    if not location:
        return None
    head, _, tail = location.rpartition(":")
    return head if head and tail.isdigit() and head.rpartition(":")[2].isdigit() else location


def _axes_text(axes: dict) -> str:
    return ", ".join(f"{n}={s}" for n, s in zip(axes["axis_names"], axes["axis_sizes"]))


def _mesh_text(plan: dict) -> str:
    mesh = plan["mesh"]
    view_of = mesh.get("view_of")
    return _axes_text(mesh) + (f" (a view of {_axes_text(view_of)})" if view_of else "")


def mesh_views_lines(plan: dict) -> list[str]:
    """One line per mesh view planned (compiler._viewed): its estimate, and which was kept."""
    views = plan.get("mesh_views") or {}
    lines = []
    for index, view in enumerate(views.get("tried", [])):
        what = (f"no plan ({view['no_plan']})" if "no_plan" in view else
                f"estimated step {format_seconds(view['step_time_s'])}, peak "
                f"{format_bytes(view['peak_bytes'])} per device")
        role = ("as given" if index == 0 else "a view") + (", kept" if index == views["chosen"]
                                                            else "")
        lines.append(f"{view['mesh']} ({role}): {what}")
    return lines


def _spec_text(spec) -> str:
    return partition_spec_text(spec)


def _type_text(entry: dict) -> str:
    return f"{entry['dtype']}[{','.join(map(str, entry['shape']))}]"


@dataclass(frozen=True)
class Chart:
    """Horizontal bars: (label, fraction of the full bar in [0, 1], value text) per row."""

    title: str
    rows: tuple[tuple[str, float, str], ...]


def _fraction(part: float, whole: float | None) -> float:
    if not whole or whole <= 0 or not math.isfinite(whole):
        return 0.0
    return min(max(part / whole, 0.0), 1.0)


def _percent(fraction: float) -> str:
    return f"{fraction:.1%}" if fraction >= 0.001 or fraction == 0 else "<0.1%"


def charts(plan: dict) -> list[Chart]:
    """The pictures of a plan: where the step time goes, peak memory against the budget, and
    what the peak holds."""
    est = plan["estimate"]
    step = est.get("step_time_s", 0.0)
    time_rows = tuple((name, _fraction(seconds, step),
                       f"{format_seconds(seconds)} ({_percent(_fraction(seconds, step))})")
                      for name, seconds in step_breakdown(plan))
    memory = memory_breakdown(plan)
    budget, peak = memory["budget_bytes"], memory["peak_bytes"]
    budget_rows = [("peak", _fraction(peak, budget),
                    f"{format_bytes(peak)} ({_percent(_fraction(peak, budget))} of budget)")]
    if budget:
        budget_rows.append(("budget", 1.0, format_bytes(budget)))
    peak_rows = tuple((name, _fraction(size, peak),
                       f"{format_bytes(size)} ({_percent(_fraction(size, peak))})")
                      for name, size in memory["parts"])
    return [
        Chart(f"Estimated step time: {format_seconds(step)}", time_rows),
        Chart("Peak memory per device against the budget", tuple(budget_rows)),
        Chart(f"What the peak holds, per device: {format_bytes(peak)}", peak_rows),
    ]


_EIGHTHS = " ▏▎▍▌▋▊▉"


def memory_check_lines(plan: dict) -> list[str]:
    """What `compile --verify-memory` measured: each plan tried, the one kept marked."""
    check = plan.get("memory_check")
    if not check:
        return []
    lines = [f"checked with XLA ({check['platform']}, allocation per device: arguments, results "
             "and temporaries):"]
    for i, t in enumerate(check["tries"]):
        lead = "  * " if i == check["kept"] else "    "
        free = f"{format_bytes(t['reserve_bytes'])} kept free"
        if t.get("no_plan"):
            lines.append(f"{lead}plan {i + 1} ({free}): no plan fits")
        else:
            lines.append(f"{lead}plan {i + 1} ({free}): estimated "
                         f"{format_bytes(t['estimated_bytes'])}, compiled "
                         f"{format_bytes(t['peak_bytes'])}, step "
                         f"{format_seconds(t['step_time_s'])}"
                         + (f" (the same programs as plan {t['same_as'] + 1})" if "same_as" in t
                            else ""))
    return lines


def text_bar(fraction: float, width: int = 30) -> str:
    """A unicode bar `width` cells wide at most, in eighths of a cell; a sliver for tiny values."""
    eighths = round(min(max(fraction, 0.0), 1.0) * width * 8)
    if fraction > 0 and eighths == 0:
        eighths = 1
    full, part = divmod(eighths, 8)
    return "█" * full + (_EIGHTHS[part] if part else "")


# -- JSON ----------------------------------------------------------------------------------------


def summary(plan: dict, top: int = 10) -> dict:
    """A machine-readable account of the plan: what it decided, its estimate, and why."""
    memory = memory_breakdown(plan)
    return {
        "ok": True,
        "input": plan.get("input"),
        "mesh": plan["mesh"],
        "mesh_views": plan.get("mesh_views"),
        "device_model": plan["device_model"],
        "memory_budget_bytes": plan.get("memory_budget_bytes"),
        "arguments": [{**a, "partition_spec": _spec_text(a["spec"])} for a in plan["arguments"]],
        "results": [{**r, "partition_spec": _spec_text(r["spec"])} for r in plan["results"]],
        "estimate": plan["estimate"],
        "step_time_breakdown": [{"name": n, "seconds": s} for n, s in step_breakdown(plan)],
        "memory": {"peak_bytes": memory["peak_bytes"], "budget_bytes": memory["budget_bytes"],
                   "fraction_of_budget": memory["fraction_of_budget"],
                   "arguments_bytes": memory["arguments_bytes"], "after": memory["after"],
                   "donation": donation(plan),
                   "parts": [{"name": n, "bytes": b} for n, b in memory["parts"]]},
        "top_ops": [{key: op[key] for key in ("id", "op", "label", "location", "strategy",
                                              "collectives", "compute_s", "communication_s",
                                              "resharding_in_s", "total_s") if key in op}
                    for op in top_ops(plan, top)],
        "decisions": plan.get("decisions", []),
        "pipeline": plan.get("pipeline"),
        "solver": plan.get("solver"),
        "memory_check": plan.get("memory_check"),
        "diagnostics": plan.get("diagnostics", []),
    }


# -- text ----------------------------------------------------------------------------------------


def render_text(plan: dict, console, top: int = 10) -> None:
    """Print the report on a rich Console."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    def table(title: str, *columns: str, right: tuple[str, ...] = ()) -> Table:
        t = Table(title=Text(title, style="bold"), title_justify="left", box=box.SIMPLE_HEAD,
                  show_edge=False, pad_edge=False)
        for column in columns:
            t.add_column(column, justify="right" if column in right else "left",
                         no_wrap=column in ("Name", "Argument", "Result", "Axis"))
        return t

    def cells(*values) -> list[Text]:
        return [v if isinstance(v, Text) else Text("" if v is None else str(v)) for v in values]

    est, mesh, device = plan["estimate"], plan["mesh"], plan["device_model"]
    source = plan.get("input", {}) or {}
    console.print(Text(f"hloplan plan for {source.get('file', '?')}: mesh {_mesh_text(plan)} "
                       f"({mesh.get('devices', '?')} devices) on {device.get('name', '?')}",
                       style="bold"))
    pipe = plan.get("pipeline") or {}
    single = (f"estimated step {format_seconds(est.get('step_time_s', 0.0))}, "
              f"peak {format_bytes(est.get('peak_memory_bytes', 0))} per device")
    remat = plan.get("rematerialized")
    if remat:  # no plan fit the budget without it
        single += (f"; recomputes {remat['values']} activations after the forward pass "
                   f"({remat['ops']} cheap ops)")
    if pipe.get("tasks"):  # the loader runs the pipeline; the tables below are the single program
        pest = pipe["estimate"]
        budget_bytes = plan.get("memory_budget_bytes")
        over = (budget_bytes is not None and est.get("peak_memory_bytes", 0) > budget_bytes)
        console.print(Text(
            f"runs {stages_text(pipe['stages'], pipe['microbatches'])}: estimated step "
            f"{format_seconds(pest['step_time_s'])}, peak "
            f"{format_bytes(max(pest['memory_per_stage_bytes']))} per device (see Pipeline)"))
        console.print(Text(f"single-program plan (below): {single}"
                           + (", over the memory budget" if over else "")))
    else:
        console.print(Text(single))
    console.print()

    links = mesh.get("links") or []
    t = table("Mesh", "Axis", "Size", "Link", right=("Size",))
    for i, (name, size) in enumerate(zip(mesh["axis_names"], mesh["axis_sizes"])):
        t.add_row(*cells(name, size, links[i] if i < len(links) else ""))
    if mesh.get("hosts"):
        t.caption = f"spread over {mesh['hosts']} hosts"
    console.print(t)
    views = mesh_views_lines(plan)
    if views:
        console.print(Text("meshes planned (--mesh-views; a view splits an axis of the mesh as "
                           "given, over the same devices in the same order):"))
        for line in views:
            console.print(Text(f"  {line}"))
        console.print()

    budget = _budget(plan)
    t = table("Device model", "Model", "Platform", "Memory per device", "Budget per device",
              right=("Memory per device", "Budget per device"))
    t.add_row(*cells(device.get("name"), device.get("platform"),
                     format_bytes(device["memory_bytes"]) if device.get("memory_bytes") else "?",
                     format_bytes(budget) if budget else "unlimited"))
    console.print(t)

    for title, entries, column in (("Arguments", plan["arguments"], "Argument"),
                                   ("Results", plan["results"], "Result")):
        t = table(title, column, "Type", "PartitionSpec", "Size", "Per device",
                  right=("Size", "Per device"))
        for entry in entries:
            t.add_row(*cells(entry["name"], _type_text(entry), _spec_text(entry["spec"]),
                             format_bytes(entry["bytes"]), format_bytes(entry["bytes_per_device"])))
        console.print(t)

    pictures = charts(plan)
    _print_chart(console, pictures[0])
    collectives = est.get("collectives") or []
    if collectives:
        t = table("Collectives per step (ops and resharding)", "Collective", "Mesh axes", "Count",
                  "Bytes sent per device", right=("Count", "Bytes sent per device"))
        for c in collectives:
            t.add_row(*cells(c["kind"], c["axes"], c["count"], format_bytes(c["bytes"])))
        console.print(t)
    for chart in pictures[1:]:
        _print_chart(console, chart)
    memory = memory_breakdown(plan)
    if memory["budget_bytes"]:
        headroom = memory["budget_bytes"] - memory["peak_bytes"]
        verdict = (f"{format_bytes(headroom)} under the budget" if headroom >= 0
                   else f"OVER the budget by {format_bytes(-headroom)}")
        console.print(Text(f"peak {format_bytes(memory['peak_bytes'])} of "
                           f"{format_bytes(memory['budget_bytes'])} per device: {verdict}"))
        if memory.get("after"):
            console.print(Text(f"the estimated peak is {memory['after']}"))
        advice = donation_line(plan)
        if advice:
            console.print(Text(advice))
        for line in memory_check_lines(plan):
            console.print(Text(line))
        console.print()

    ops = top_ops(plan, top)
    if ops:
        step = est.get("step_time_s", 0.0)
        t = table(f"Top {len(ops)} ops by estimated time", "Op", "Location", "Strategy",
                  "Collectives", "Time", "Share", right=("Time", "Share"))
        for op in ops:
            name = (op.get("label") or op["op"]).rsplit("/", 1)[-1]
            t.add_row(*cells(f"{op['id']} {name}", op["where"] or "-", op["strategy"],
                             ", ".join(op["collectives"]) or "-", format_seconds(op["total_s"]),
                             _percent(_fraction(op["total_s"], step))))
        console.print(t)

    decisions = plan.get("decisions")
    console.print(Text("Decisions and why", style="bold"))
    if decisions is None:
        console.print(Text("  (this plan.json predates decisions; recompile to see them)"))
    elif not decisions:
        console.print(Text("  (no choice to explain: every op has a single strategy)"))
    if decisions:
        grid = Table.grid(padding=(0, 1))
        grid.add_column(justify="right", no_wrap=True)
        grid.add_column()
        for d in decisions:
            where = f" [{_short_location(d['location'])}]" if d.get("location") else ""
            delta = d.get("delta", {})
            body = Text(f"{d['kind']} {d['id']} {d['name']}{where}\n", style="bold")
            body.append(d["reason"] + "\n", style="")
            body.append(f"next best: step {_signed_seconds(delta.get('total_s', 0.0))}, "
                        f"peak {_signed_bytes(delta.get('peak_memory_bytes', 0))}"
                        f"{'' if d.get('next_best_feasible', True) else ', over the budget'}",
                        style="dim")
            grid.add_row(Text(f"{d['rank']}."), body)
        console.print(grid)
    _render_pipeline(plan, console, table, cells)
    solver = plan.get("solver") or {}
    if solver:
        console.print()
        console.print(Text(f"solver {solver.get('name')}: {solver.get('status')}, gap "
                           f"{solver.get('gap', 0):.2%}, {solver.get('nodes')} decisions, "
                           f"{solver.get('edges')} resharding edges, "
                           f"{solver.get('memory_points')} memory points", style="dim"))
        tying = solver.get("tying") or {}
        if tying.get("groups"):
            line = (f"repeated layers: {tying.get('tied_ops')} ops in {tying['groups']} groups share "
                    f"decisions ({tying.get('decisions_before')} -> "
                    f"{tying.get('decisions_after')})")
            if "gap_to_untied" in tying:
                against = "optimum" if tying.get("gap_to_untied_exact") else "incumbent"
                line += f"; {tying['gap_to_untied']:+.3%} from the untied {against}"
            console.print(Text(line, style="dim"))


def pipeline_timeline(pipe: dict, width: int = 60) -> list[str]:
    """One line per stage: which microbatch's forward (digits) or backward (letters) runs when,
    from a simulation of the dispatch order with each task taking its estimated time."""
    tasks = {t["index"]: t for t in pipe["tasks"]}
    stage_free = [0.0] * pipe["stages"]
    done: dict[tuple[int, int], float] = {}
    producer = {v: t["index"] for t in pipe["tasks"] if t["part"] == "A" for v in t["outputs"]}
    spans: list[tuple[int, float, float, str]] = []
    first_phase = {}
    for t in pipe["tasks"]:
        if t["part"] == "A":
            first_phase[t["stage"]] = min(first_phase.get(t["stage"], t["phase"]), t["phase"])
    for task_index, m in pipe["order"]:
        task = tasks[task_index]
        ready = max([done.get((producer[v], m), 0.0) for v in task["inputs"] if v in producer]
                    + [stage_free[task["stage"]]])
        end = ready + max(task["estimated_s"], 1e-12)
        done[(task_index, m)] = end
        stage_free[task["stage"]] = end
        forward = task["phase"] == first_phase[task["stage"]]
        mark = str(m % 10) if forward else "abcdefghij"[m % 10]
        spans.append((task["stage"], ready, end, mark))
    total = max((end for _, _, end, _ in spans), default=0.0) or 1.0
    lines = []
    for stage in range(pipe["stages"]):
        row = ["."] * width
        for s, start, end, mark in spans:
            if s != stage:
                continue
            lo, hi = int(start / total * width), max(int(end / total * width), int(start / total * width) + 1)
            for i in range(lo, min(hi, width)):
                row[i] = mark
        lines.append(f"stage {stage} |{''.join(row)}|")
    return lines


def device_ranges(devices: list[int]) -> str:
    """[0, 1, 2, 3, 8, 9] -> '0-3,8-9'."""
    runs: list[list[int]] = []
    for d in devices:
        if runs and d == runs[-1][1] + 1:
            runs[-1][1] = d
        else:
            runs.append([d, d])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _candidate_text(c: dict) -> str:
    text = stages_text(c['stages'], c['microbatches'])
    if c.get("submeshes"):
        text += f" on {' + '.join(c['submeshes'])}"
    return text


def _print_search(console, search: dict | None) -> None:
    from rich.text import Text

    if not search:
        return
    console.print(Text(
        f"Stage search: {search['layers']} layers x {len(search['submesh_shapes'])} submesh "
        f"shapes ({', '.join(search['submesh_shapes'])}) x microbatches "
        f"{', '.join(sorted(search.get('microbatches_stages', {}), key=int))}: {search['pairs']} "
        f"(range, submesh) "
        f"pairs, {search['pairs_planned']} planned with the ILP ({search['ilp_solves']} solves), "
        f"the rest priced by a roofline lower bound; "
        + (f"optimal under the cost model (within {search.get('gap', 0):.0%})"
           if search.get("optimal") else f"stopped at {search['max_solves']} solves"),
        style="dim"))


def _render_pipeline(plan: dict, console, table, cells) -> None:
    from rich.text import Text

    pipe = plan.get("pipeline")
    if not pipe:
        return
    console.print()
    if not pipe.get("tasks"):
        console.print(Text("Pipeline: none — " + pipe.get("chosen", "one stage"), style="bold"))
        for c in pipe.get("candidates", []):
            console.print(Text(f"  {_candidate_text(c)}: {format_seconds(c['step_time_s'])}"
                               + ("" if c.get("fits", True) else " (does not fit)")))
        _print_search(console, pipe.get("search"))
        return
    est = pipe["estimate"]
    console.print(Text(
        f"Pipeline: {stages_text(pipe['stages'], pipe['microbatches'])}"
        + (" on " + " + ".join(f"{s['shape'][0]}x{s['shape'][1]}" for s in pipe["submeshes"])
           if all("shape" in s for s in pipe["submeshes"]) else "")
        + f", {pipe['schedule']}; batch {pipe['batch_size']} in {', '.join(pipe['batch_arguments'])}; "
        f"estimated step {format_seconds(est['step_time_s'])}, bubble "
        f"{est['bubble_fraction']:.0%} ((S-1)/(M+S-1))", style="bold"))
    t = table("Stages", "Stage", "Devices", "Mesh", "Layers", "Time per microbatch", "Memory",
              "Source lines", right=("Time per microbatch", "Memory"))
    per_stage = {p["stage"]: p for p in pipe.get("per_stage", [])}
    for stage, sub in enumerate(pipe["submeshes"]):
        lines = sorted({line for task in pipe["tasks"] if task["stage"] == stage
                        for line in task.get("source_lines", [])})
        mesh = ",".join(f"{n}={s}" for n, s in zip(sub["axis_names"], sub["axis_sizes"]))
        layers = per_stage.get(stage, {}).get("layers")
        t.add_row(*cells(str(stage), device_ranges(sub["devices"]), mesh,
                         ("" if not layers else str(layers[0]) if layers[1] - layers[0] == 1
                          else f"{layers[0]}-{layers[1] - 1}"),
                         format_seconds(est["stage_time_s"][stage]),
                         format_bytes(est["memory_per_stage_bytes"][stage]),
                         ", ".join(lines[:3]) + (" ..." if len(lines) > 3 else "")))
    console.print(t)
    _print_search(console, pipe.get("search"))
    console.print(Text("Timeline (digits: forward of microbatch m, letters: its backward)",
                       style="bold"))
    for line in pipeline_timeline(pipe):
        console.print(Text(line))


def _signed_seconds(seconds: float) -> str:
    return ("+" if seconds >= 0 else "-") + format_seconds(abs(seconds))


def _signed_bytes(nbytes: float) -> str:
    return ("+" if nbytes >= 0 else "-") + format_bytes(abs(nbytes))


def _print_chart(console, chart: Chart, width: int = 30) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    t = Table(title=Text(chart.title, style="bold"), title_justify="left", box=box.SIMPLE_HEAD,
              show_edge=False, show_header=False, pad_edge=False)
    t.add_column("what", no_wrap=True)
    t.add_column("bar", min_width=width, no_wrap=True)
    t.add_column("value", justify="right", no_wrap=True)
    for label, fraction, value in chart.rows:
        t.add_row(Text(label), Text(text_bar(fraction, width), style="cyan"), Text(value))
    console.print(t)


# -- SVG -----------------------------------------------------------------------------------------


def bars_svg(plan: dict) -> str:
    """The charts of `charts(plan)` as a standalone SVG document."""
    label_w, bar_w, value_w, row_h, pad = 260, 360, 220, 22, 16
    width = pad * 2 + label_w + bar_w + value_w
    colors = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#eeca3b")
    parts: list[str] = []
    y = pad
    title = f"hloplan: {(plan.get('input') or {}).get('file', 'plan')} on mesh {_mesh_text(plan)}"
    parts.append(f'<text x="{pad}" y="{y + 14}" class="title">{escape(title)}</text>')
    y += 30
    for chart in charts(plan):
        parts.append(f'<text x="{pad}" y="{y + 14}" class="chart">{escape(chart.title)}</text>')
        y += 24
        for i, (label, fraction, value) in enumerate(chart.rows):
            shown = label if len(label) <= 38 else label[:37] + "…"
            x_bar = pad + label_w
            w = bar_w * fraction
            if fraction > 0:
                w = max(w, 1.0)
            parts.append(f'<text x="{pad}" y="{y + 15}">{escape(shown)}</text>')
            parts.append(f'<rect x="{x_bar}" y="{y + 3}" width="{bar_w}" height="{row_h - 6}" '
                         f'fill="#eeeeee"/>')
            parts.append(f'<rect x="{x_bar}" y="{y + 3}" width="{w:.2f}" height="{row_h - 6}" '
                         f'fill="{colors[i % len(colors)]}"><title>{escape(label)}: '
                         f'{escape(value)}</title></rect>')
            parts.append(f'<text x="{x_bar + bar_w + 8}" y="{y + 15}">{escape(value)}</text>')
            y += row_h
        y += 14
    height = y + pad
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">\n'
            '<style>.title{font-size:15px;font-weight:bold}.chart{font-size:13px;'
            'font-weight:bold}</style>\n'
            f'<rect width="{width}" height="{height}" fill="white"/>\n')
    return head + "\n".join(parts) + "\n</svg>\n"


# -- jax -----------------------------------------------------------------------------------------


class _Spec:
    """A leaf standing for a PartitionSpec in a pytree, printing as source text."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _axes_of(spec) -> list[list[str]]:
    """PartitionSpec -> per-dim axis-name lists."""
    out = []
    for entry in tuple(spec):
        if entry is None:
            out.append([])
        elif isinstance(entry, str):
            out.append([entry])
        else:
            out.append([str(a) for a in entry])
    return out


def _flat_specs(exported, side: str) -> list[list[list[str]]]:
    """Per flat argument ('in') or result ('out') of the sharded Exported: its spec."""
    method = exported.in_shardings_jax if side == "in" else exported.out_shardings_jax
    avals = exported.in_avals if side == "in" else exported.out_avals
    try:
        shardings = method(None)  # the named shardings the plan exported, on its abstract mesh
    except Exception:  # an Exported without named shardings
        shardings = (None,) * len(avals)
    specs = []
    for sharding, aval in zip(shardings, avals):
        spec = getattr(sharding, "spec", None)
        specs.append(_axes_of(spec) if spec is not None else [[] for _ in aval.shape])
    return specs


class _CustomNode(Exception):
    pass


def _source(tree, indent: int = 0, width: int = 96) -> str:
    """Python source of a pytree of tuples, lists, dicts, None and _Spec leaves."""
    flat = _one_line(tree)
    if len(flat) + indent * 4 <= width or isinstance(tree, _Spec) or tree is None:
        return flat
    pad, inner = "    " * indent, "    " * (indent + 1)
    if isinstance(tree, dict):
        items = [f"{inner}{k!r}: {_source(v, indent + 1, width)}," for k, v in tree.items()]
        return "{\n" + "\n".join(items) + f"\n{pad}}}"
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        items = [f"{inner}{f}={_source(v, indent + 1, width)},"
                 for f, v in zip(tree._fields, tree)]
        return f"{type(tree).__name__}(\n" + "\n".join(items) + f"\n{pad})"
    if isinstance(tree, (list, tuple)):
        open_, close = ("[", "]") if isinstance(tree, list) else ("(", ")")
        items = [f"{inner}{_source(v, indent + 1, width)}," for v in tree]
        return open_ + "\n" + "\n".join(items) + f"\n{pad}{close}"
    raise _CustomNode(type(tree).__name__)


def _one_line(tree) -> str:
    if isinstance(tree, _Spec) or tree is None:
        return repr(tree)
    if isinstance(tree, dict):
        return "{" + ", ".join(f"{k!r}: {_one_line(v)}" for k, v in tree.items()) + "}"
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return (f"{type(tree).__name__}("
                + ", ".join(f"{f}={_one_line(v)}" for f, v in zip(tree._fields, tree)) + ")")
    if isinstance(tree, list):
        return "[" + ", ".join(_one_line(v) for v in tree) + "]"
    if isinstance(tree, tuple):
        if len(tree) == 1:
            return f"({_one_line(tree[0])},)"
        return "(" + ", ".join(_one_line(v) for v in tree) + ")"
    raise _CustomNode(type(tree).__name__)


def _namedtuple_types(tree, found: set[str]) -> set[str]:
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        found.add(type(tree).__name__)
    if isinstance(tree, dict):
        for v in tree.values():
            _namedtuple_types(v, found)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _namedtuple_types(v, found)
    return found


def _donate_text(plan: dict, args: tuple) -> str:
    """`, donate_argnums=(...)` for the positional arguments whose leaves the export donates
    (plan.json `donation`), as the original jax.jit donated them."""
    import jax

    donated = set((plan.get("donation") or {}).get("arguments", []))
    positions, start = [], 0
    for position, arg in enumerate(args):
        count = len(jax.tree.leaves(arg))
        if count and all(leaf in donated for leaf in range(start, start + count)):
            positions.append(position)
        start += count
    if not positions:
        return ""
    listed = ", ".join(map(str, positions)) + ("," if len(positions) == 1 else "")
    return f", donate_argnums=({listed})"


def _tuple_source(values) -> str:
    """A Python tuple literal: (8,), ('x', 'y')."""
    return "(" + ", ".join(map(repr, values)) + ("," if len(values) == 1 else "") + ")"


def _mesh_source(plan: dict) -> list[str]:
    """Comment lines building the plan's mesh; for a view (compiler._viewed), the mesh asked for
    reshaped, so that every device keeps its place."""
    mesh, view_of = plan["mesh"], plan["mesh"].get("view_of")
    shape = _tuple_source([int(s) for s in mesh["axis_sizes"]])
    names = _tuple_source(mesh["axis_names"])
    types = f"axis_types=(AxisType.Auto,) * {len(mesh['axis_names'])}"
    if not view_of:
        return [f"#   mesh = jax.make_mesh({shape}, {names}, {types})"]
    return [f"#   given = jax.make_mesh({_tuple_source(view_of['axis_sizes'])}, "
            f"{_tuple_source(view_of['axis_names'])})  # the mesh asked for; the plan is on "
            "this view of it:",
            f"#   mesh = jax.sharding.Mesh(given.devices.reshape{shape}, {names}, {types})"]


def jax_source(plan: dict, exported) -> str:
    """Python source defining `in_shardings` (the positional arguments' pytree) and
    `out_shardings` (the results' pytree) as PartitionSpecs, with how to use them."""
    import jax

    in_leaves = [_Spec(partition_spec_text(s)) for s in _flat_specs(exported, "in")]
    out_leaves = [_Spec(partition_spec_text(s)) for s in _flat_specs(exported, "out")]
    args, kwargs = jax.tree.unflatten(exported.in_tree, in_leaves)
    results = jax.tree.unflatten(exported.out_tree, out_leaves)
    source = plan.get("input") or {}
    lines = [
        f"# Shardings planned by hloplan for {source.get('file', 'the program')} on mesh "
        f"{_mesh_text(plan)} ({plan['device_model'].get('name', '?')}).",
        "from jax.sharding import PartitionSpec as P",
        "",
    ]
    try:
        lines.append(f"in_shardings = {_source(tuple(args))}")
        if kwargs:
            lines.append(f"in_shardings_kwargs = {_source(dict(kwargs))}")
        lines.append(f"out_shardings = {_source(results)}")
        custom = sorted(_namedtuple_types((args, kwargs, results), set()))
    except _CustomNode as exc:
        # Custom pytree nodes have no literal syntax: give the flat leaves, in pytree order.
        lines += [
            f"# The arguments or results contain custom pytree nodes ({exc}); these are the",
            "# leaves in pytree order: rebuild the trees with jax.tree.unflatten(jax.tree.structure(",
            "# (args, kwargs)), in_shardings_flat) and likewise for the results.",
            f"in_shardings_flat = {_source(list(in_leaves))}",
            f"out_shardings_flat = {_source(list(out_leaves))}",
        ]
        custom = []
    if custom:
        lines.insert(2, "# named tuples used below (import them from your code): "
                     + ", ".join(custom))
    lines += [
        "",
        "# Use them with jax.jit and a Mesh of the same axes (Auto axes, as planned):",
        "#   import jax",
        "#   from jax.sharding import AxisType, NamedSharding",
        *_mesh_source(plan),
        "#   named = lambda tree: jax.tree.map(lambda p: NamedSharding(mesh, p), tree,",
        "#                                     is_leaf=lambda x: isinstance(x, P))",
        "#   step = jax.jit(f, in_shardings=named(in_shardings), "
        f"out_shardings=named(out_shardings){_donate_text(plan, args)})",
        "# or load the compiled plan itself: step = hloplan.load(PLAN_DIR)",
    ]
    return "\n".join(lines) + "\n"


def _named_tree(plan_dir, mesh, side: str):
    import jax
    from jax.sharding import NamedSharding

    from hloplan.emit.loader import build_mesh

    plan = load_plan_dir(plan_dir)
    exported = load_exported(plan_dir)
    if mesh is None:
        mesh = build_mesh(plan)
    leaves = [NamedSharding(mesh, _partition_spec(s)) for s in _flat_specs(exported, side)]
    if side == "in":
        args, _kwargs = jax.tree.unflatten(exported.in_tree, leaves)
        return tuple(args)
    return jax.tree.unflatten(exported.out_tree, leaves)


def _partition_spec(axes: list[list[str]]):
    from jax.sharding import PartitionSpec

    entries = [None if not a else a[0] if len(a) == 1 else tuple(a) for a in axes]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def in_shardings(plan_dir, mesh=None):
    """The plan's shardings of the positional arguments: a tuple (one entry per argument of the
    original function) of pytrees of NamedSharding on `mesh` (default: the plan's mesh over
    jax.devices()), ready for `jax.jit(f, in_shardings=...)` or `jax.device_put`."""
    return _named_tree(plan_dir, mesh, "in")


def out_shardings(plan_dir, mesh=None):
    """The plan's shardings of the results, as the original function's result pytree."""
    return _named_tree(plan_dir, mesh, "out")
