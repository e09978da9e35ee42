"""`hloplan explain`: what a plan decided, what it is estimated to cost, and why.

Everything here reads a plan as plan.json writes it (see hloplan.plan.build_plan), so a plan
directory and a plan made in memory render the same way:

- `render_text`: rich tables (mesh, device model, arguments and results with their PartitionSpec,
  step-time split, collectives, memory against the budget, the costliest ops, the decisions and
  their reasons) and horizontal bars;
- `summary`: the same as plain JSON data;
- `strategy_paragraph`: the parallelism chosen, in practitioners' words (explain's first lines);
- `jax_source`: Python that runs as pasted: the plan's mesh over jax.devices(), `in_shardings` /
  `out_shardings` pytrees of NamedSharding matching the original function's arguments and
  results, and `jit(f)` with them (hloplan.explain_picture draws the plan);
- `in_shardings(plan_dir, mesh)` / `out_shardings(plan_dir, mesh)`: the same as NamedShardings.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from hloplan.decisions import partition_spec_text
from hloplan.diagnostics import UsageError
from hloplan.units import format_bytes, format_seconds, stages_text

__all__ = [
    "Chart",
    "PlanDirError",
    "charts",
    "in_shardings",
    "jax_source",
    "load_exported",
    "load_plan_dir",
    "memory_breakdown",
    "out_shardings",
    "pipeline_spans",
    "render_text",
    "step_breakdown",
    "strategy_paragraph",
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
    validate_plan(plan, directory)
    from hloplan.diagnostics import escape_strings
    from hloplan.emit.loader import PlanLoadError, check_plan_fields, verify_files

    try:  # the fields run reads, and the artifacts against their digests
        check_plan_fields(plan, path)
        verify_files(plan, directory)
    except PlanLoadError as exc:
        raise PlanDirError(str(exc), directory) from None
    return escape_strings(plan)


def validate_plan(plan: object, directory: str | Path | None = None) -> None:
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
    """'/home/me/project/model.py:12:5' -> 'model.py:12' (the file's name and the line)."""
    if not location:
        return None
    head, _, tail = location.rpartition(":")
    if head and tail.isdigit() and head.rpartition(":")[2].isdigit():
        location = head
    path, _, line = location.rpartition(":")
    if path and line.isdigit():
        return f"{path.replace(chr(92), '/').rsplit('/', 1)[-1]}:{line}"
    return location


def _axes_text(axes: dict) -> str:
    return ", ".join(f"{n}={s}" for n, s in zip(axes["axis_names"], axes["axis_sizes"]))


def _mesh_text(plan: dict) -> str:
    mesh = plan["mesh"]
    view_of = mesh.get("view_of")
    return _axes_text(mesh) + (f" (a view of {_axes_text(view_of)})" if view_of else "")


def mesh_views_lines(plan: dict) -> list[str]:
    """One line per mesh view planned (compiler.plan_on_views): its estimate, and which was kept."""
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


def selection_lines(plan: dict) -> list[str]:
    """What `compile --select compiled` compiled: each candidate's estimated and compiled
    step, the one kept marked, and why it won."""
    sel = plan.get("selection")
    if not sel:
        return []
    where = sel["platform"] + (f", {sel['topology']}" if sel.get("topology") else "")
    lines = [f"candidates compiled by XLA ({where}), scored on the compiled HLO "
             f"(hloplan.score, {sel['score_device']}):"]
    for c in sel["candidates"]:
        lead = "  * " if c["name"] == sel["chosen"] else "    "
        if "no_plan" in c:
            lines.append(f"{lead}{c['name']}: no plan ({c['no_plan']})")
        elif "same_plan_as" in c:
            lines.append(f"{lead}{c['name']}: estimated {format_seconds(c['estimated_step_s'])}, "
                         f"the same plan as {c['same_plan_as']}")
        elif "compile_error" in c:
            lines.append(f"{lead}{c['name']}: estimated {format_seconds(c['estimated_step_s'])}, "
                         f"not compiled ({c['compile_error']})")
        else:
            lines.append(f"{lead}{c['name']}: estimated {format_seconds(c['estimated_step_s'])}, "
                         f"compiled {format_seconds(c['compiled_step_s'])} (kernels "
                         f"{format_seconds(c['compiled_kernels_s'])}, collectives "
                         f"{format_seconds(c['compiled_communication_s'])}), peak "
                         f"{format_bytes(c['compiled_peak_bytes'])}"
                         + ("" if c["fits"] else " OVER the budget"))
    lines.append(f"kept {sel['chosen']}: {sel['why']}")
    if sel.get("superseded"):
        lines.append(f"then {sel['superseded']}")
    return lines


def text_bar(fraction: float, width: int = 30) -> str:
    """A unicode bar `width` cells wide at most, in eighths of a cell; a sliver for tiny values."""
    eighths = round(min(max(fraction, 0.0), 1.0) * width * 8)
    if fraction > 0 and eighths == 0:
        eighths = 1
    full, part = divmod(eighths, 8)
    return "█" * full + (_EIGHTHS[part] if part else "")


# -- the strategy in practitioners' words ---------------------------------------------------------

_TOP_NAME = re.compile(r"^([^\[.]+)")


def _top(name: str) -> str:
    """'params['w']' -> 'params'; 'result[1]['w']' -> 'result[1]'."""
    match = _TOP_NAME.match(name)
    head = match.group(1) if match else name
    rest = name[len(head):]
    if head in ("result", "args", "arg") and rest.startswith("["):
        head += rest[:rest.index("]") + 1]
    return head


def _suffix(name: str) -> str:
    return name[len(_top(name)):]


def _dim_axes(entry: dict, dim: int) -> list[str]:
    spec = entry.get("spec") or []
    return list(spec[dim]) if dim < len(spec) else []


def _sharded_axes(entry: dict) -> set[str]:
    return {axis for dim in entry.get("spec") or [] for axis in dim}


def _axes_phrase(plan: dict, axes) -> str:
    """'y: 4-way', '(x, y): 8-way'."""
    sizes = dict(zip(plan["mesh"]["axis_names"], plan["mesh"]["axis_sizes"]))
    ordered = [a for a in plan["mesh"]["axis_names"] if a in set(axes)]
    ways = math.prod(int(sizes[a]) for a in ordered)
    where = ordered[0] if len(ordered) == 1 else "(" + ", ".join(ordered) + ")"
    return f"over {where}: {ways}-way"


_PATH_PART = re.compile(r"^[^\[.]+|\[[^\]]*\]|\.[A-Za-z_][A-Za-z0-9_]*")


def _params_hint(prefix: str) -> int:
    """+1 for a path that names parameters, -1 for one that names optimizer state: which of
    several mirrored subtrees are the parameters (else the first in argument order)."""
    lower = prefix.lower()
    if re.search(r"opt|moment|\bmu\b|\bnu\b|\['[mv]'\]|\.[mv]\b|momentum|adam", lower):
        return -1
    return 1 if re.search(r"param|weight|model", lower) else 0


def _mirrored_state(args: list[dict]) -> tuple[list[int], list[int]]:
    """(parameters, optimizer state) found as mirrored subtrees: optimizer moments (Adam's m
    and v, momentum) hold a leaf of the same shape at the same relative path for every
    parameter, wherever the user nested them (`params` and `opt_state['m']`, or
    `state['params']` and `state['opt']['m']`). Of the subtrees that mirror one another, the
    largest set whose subtrees together hold most of their top-level argument's bytes, and
    that are not repeated layers (siblings `[0]`, `[1]` of one list), is taken; its first
    subtree named as parameters (else the first) is the parameters. ([], []) when there is
    none."""
    groups: dict[frozenset, list[str]] = {}
    members: dict[str, list[int]] = {}
    for index, entry in enumerate(args):
        parts = _PATH_PART.findall(entry["name"])
        for cut in range(1, len(parts)):
            prefix = "".join(parts[:cut])
            members.setdefault(prefix, []).append(index)
    signature: dict[str, set] = {}
    for prefix, indices in members.items():
        signature[prefix] = frozenset((args[i]["name"][len(prefix):], tuple(args[i]["shape"]))
                                      for i in indices)
    for prefix, sig in signature.items():
        groups.setdefault(sig, []).append(prefix)
    top_bytes: dict[str, int] = {}
    for entry in args:
        top_bytes[_top(entry["name"])] = top_bytes.get(_top(entry["name"]), 0) + entry["bytes"]
    best, best_bytes = None, 0
    for prefixes in groups.values():
        # disjoint subtrees only (a prefix and its own child may share a signature)
        chosen: list[str] = []
        for prefix in prefixes:
            if not any(prefix.startswith(c) or c.startswith(prefix) for c in chosen):
                chosen.append(prefix)
        if len(chosen) < 2:
            continue
        parents = {c[:c.rfind("[")] if c.endswith("]") else c for c in chosen}
        if len(parents) == 1 and all(re.fullmatch(r".*\[\d+\]", c) for c in chosen):
            continue  # repeated layers of one list, not a mirror of the parameters
        sizes = {c: sum(args[i]["bytes"] for i in members[c]) for c in chosen}
        tops: dict[str, int] = {}
        for c in chosen:
            tops[_top(c)] = tops.get(_top(c), 0) + sizes[c]
        if any(held * 2 < top_bytes[top] for top, held in tops.items()):
            continue
        first = min(chosen, key=lambda c: (-_params_hint(c), members[c][0]))
        if sizes[first] > best_bytes:
            best, best_bytes = (first, [c for c in chosen if c != first]), sizes[first]
    if best is None:
        return [], []
    first, others = best
    return list(members[first]), sorted(i for c in others for i in members[c])


def argument_roles(plan: dict) -> dict:
    """Which arguments are the model's parameters, its optimizer state, other state and the
    batch, read from the plan alone: arguments are grouped by their top-level name (the
    function's parameter); a group the step returns again, leaf for leaf, is state; the first
    state group (or, in a program that returns no state, the largest group) holds the
    parameters; a later state group whose leaves have the parameters' shapes is optimizer
    state; a group that is not state and whose leaves share a leading dimension is the batch.
    Returns {'params': [...], 'optimizer': [...], 'state': [...], 'batch': [...]} of argument
    indices."""
    args = plan["arguments"]
    groups: dict[str, list[int]] = {}
    for index, entry in enumerate(args):
        groups.setdefault(_top(entry["name"]), []).append(index)
    returned: dict[str, set] = {}
    for entry in plan["results"]:
        returned.setdefault(_top(entry["name"]), set()).add(
            (_suffix(entry["name"]), tuple(entry["shape"])))
    result_groups = list(returned.values())

    def is_state(members: list[int]) -> bool:
        leaves = {(_suffix(args[i]["name"]), tuple(args[i]["shape"])) for i in members}
        return any(leaves <= group for group in result_groups) and len(leaves) > 0

    def group_bytes(members: list[int]) -> int:
        return sum(args[i]["bytes"] for i in members)

    roles: dict[str, list[int]] = {"params": [], "optimizer": [], "state": [], "batch": []}
    params, optimizer = _mirrored_state(args)
    if params:
        roles["params"], roles["optimizer"] = params, optimizer
        taken = set(params) | set(optimizer)
        for members in groups.values():
            rest = [i for i in members if i not in taken]
            if not rest:
                continue
            leading = {tuple(args[i]["shape"])[:1] for i in rest if args[i]["shape"]}
            batch = (not is_state(rest) and len(leading) == 1
                     and next(iter(leading), (0,))[0] > 1)
            roles["batch" if batch else "state"] += rest
        return roles
    state = [name for name, members in groups.items() if is_state(members)]
    others = [name for name in groups if name not in state]
    if state:
        params = max(state[:1] + [n for n in state if "param" in n.lower()],
                     key=lambda n: ("param" in n.lower(), -state.index(n)))
    elif others:
        # no state returned (a forward pass): the largest non-batch-like group holds the weights
        params = max(others, key=lambda n: group_bytes(groups[n]))
    else:
        return roles
    roles["params"] = groups[params]
    for name in state:
        if name == params:
            continue
        members = groups[name]
        # optimizer moments mirror the parameters: most of the parameters' bytes have a leaf of
        # their shape here (a BatchNorm's running statistics mirror only the norms' scales)
        like = {tuple(args[i]["shape"]) for i in members}
        mirrored = sum(args[i]["bytes"] for i in groups[params]
                       if tuple(args[i]["shape"]) in like)
        optimizer = mirrored * 2 >= group_bytes(groups[params]) > 0
        roles["optimizer" if optimizer else "state"] += members
    for name in others:
        if name == params:
            continue
        members = groups[name]
        leading = {tuple(args[i]["shape"])[:1] for i in members if args[i]["shape"]}
        if len(leading) == 1 and next(iter(leading))[0] > 1:
            roles["batch"] += members
        else:
            roles["state"] += members
    return roles


def _weighted_axes(plan: dict, indices: list[int], min_rank: int = 2) -> dict[str, float]:
    """Per mesh axis: the fraction of these arguments' bytes (of rank >= min_rank) sharded
    over it."""
    args = plan["arguments"]
    chosen = [args[i] for i in indices if len(args[i]["shape"]) >= min_rank] or \
        [args[i] for i in indices]
    total = float(sum(a["bytes"] for a in chosen)) or 1.0
    out: dict[str, float] = {}
    for a in chosen:
        for axis in _sharded_axes(a):
            out[axis] = out.get(axis, 0.0) + a["bytes"] / total
    return out


def _fully_replicated(plan: dict) -> bool:
    entries = list(plan["arguments"]) + list(plan["results"])
    if any(_sharded_axes(e) for e in entries):
        return False
    for op in plan.get("ops", []):
        for result in op.get("results") or []:
            if any(dim for dim in result):
                return False
    return True


def strategy_phrases(plan: dict) -> list[str]:
    """The parallelism the plan chose, in the words practitioners use (data parallel, FSDP /
    ZeRO stage, tensor, sequence and expert parallel, pipeline), each with its mesh axes."""
    mesh = plan["mesh"]
    names = list(mesh["axis_names"])
    phrases: list[str] = []
    if _fully_replicated(plan):
        devices = mesh.get("devices") or math.prod(int(s) for s in mesh["axis_sizes"])
        phrases.append(f"fully replicated: every one of the {devices} devices runs the whole "
                       "program on the whole batch (no parallelism: nothing was worth splitting "
                       "under this cost model)")
        return phrases
    args = plan["arguments"]
    roles = argument_roles(plan)
    batch = [args[i] for i in roles["batch"]]
    batch_axes: list[str] = []
    seq_axes: list[str] = []
    feature_axes: list[str] = []

    def add(into: list[str], axes) -> None:
        into.extend(a for a in axes if a not in into and a not in batch_axes)

    for a in sorted(batch, key=lambda a: -a["bytes"]):
        add(batch_axes, _dim_axes(a, 0))
    for a in batch:
        rank, integer = len(a["shape"]), a["dtype"].startswith(("i", "u"))
        # [batch, sequence] token ids, [batch, sequence, features], [batch, h, w, channels]:
        # the dims after the batch and before the features are positions; the last dim of
        # float data is its features, whose split is a split of the first layer's compute
        positions = range(1, rank) if integer else range(1, rank - 1)
        for dim in positions:
            add(seq_axes, _dim_axes(a, dim))
        if not integer and rank >= 2:
            add(feature_axes, _dim_axes(a, rank - 1))
    seq_axes = [a for a in seq_axes if a not in batch_axes]
    feature_axes = [a for a in feature_axes if a not in batch_axes and a not in seq_axes]
    if batch_axes:
        phrases.append(f"batch {_axes_phrase(plan, batch_axes)} data parallel")
    if seq_axes:
        kind = "spatial" if batch and max(len(a["shape"]) for a in batch) >= 4 else "sequence"
        phrases.append(f"{kind} {_axes_phrase(plan, seq_axes)} {kind} parallel")
    data_axes = set(batch_axes) | set(seq_axes)
    params = _weighted_axes(plan, roles["params"])
    optimizer = _weighted_axes(plan, roles["optimizer"]) if roles["optimizer"] else {}
    # a weight split over an axis the data also uses is stored sharded and gathered to be used
    # (FSDP / ZeRO-3); over an axis the data does not use, the compute is split (tensor parallel)
    fsdp = [a for a in names if params.get(a, 0.0) >= 0.5 and a in data_axes]
    tensor = [a for a in names if params.get(a, 0.0) >= 0.25 and a not in data_axes]
    experts = sorted({axis for i in roles["params"] if "expert" in args[i]["name"].lower()
                      and len(args[i]["shape"]) >= 3 for axis in _dim_axes(args[i], 0)},
                     key=names.index)
    if experts:
        phrases.append(f"experts {_axes_phrase(plan, experts)} expert parallel")
    tensor = [a for a in names if (a in tensor or a in feature_axes) and a not in experts]
    if tensor:
        split = [args[i] for i in roles["params"] if len(args[i]["shape"]) >= 2
                 and _sharded_axes(args[i]) & set(tensor)]
        largest = max(split, key=lambda a: a["bytes"], default=None)
        example = f" (largest: {largest['name']})" if largest else ""
        phrases.append(f"weights split {_axes_phrase(plan, tensor)} tensor parallel{example}")
    if fsdp:
        phrases.append(f"parameters sharded {_axes_phrase(plan, fsdp)} FSDP (ZeRO-3)")
    elif roles["params"] and roles["optimizer"]:
        zero = [a for a in names if optimizer.get(a, 0.0) >= 0.5 and a in data_axes
                and a not in tensor]
        if zero:
            scattered = any(c.get("kind") == "reduce-scatter" and
                            set(c.get("axes", "").split(",")) & set(zero)
                            for c in plan["estimate"].get("collectives") or [])
            stage = "ZeRO-2: gradients reduce-scattered" if scattered else "ZeRO-1"
            phrases.append(f"optimizer state sharded {_axes_phrase(plan, zero)} ({stage})")
    if data_axes and not fsdp and roles["params"] and not params:
        phrases.append("parameters replicated")
    if not phrases:
        axes = sorted({a for e in args for a in _sharded_axes(e)}, key=names.index)
        if axes:
            phrases.append(f"tensors split {_axes_phrase(plan, axes)}")
    unused = [a for a in names if int(mesh["axis_sizes"][names.index(a)]) > 1 and not any(
        a in p for p in (batch_axes, seq_axes, fsdp, tensor, experts, feature_axes))
        and not any(a in _sharded_axes(e) for e in args)]
    if unused and not _fully_replicated(plan):
        phrases.append(f"mesh axis {', '.join(unused)} unused (replicated over it)")
    return phrases


def strategy_paragraph(plan: dict) -> str:
    """`strategy_phrases` as the paragraph `hloplan explain` opens with."""
    from hloplan.units import format_bytes as fb
    from hloplan.units import format_seconds as fs

    est = plan["estimate"]
    text = "; ".join(strategy_phrases(plan))
    text = text[:1].upper() + text[1:] + "."
    pipe = plan.get("pipeline") or {}
    if pipe.get("tasks"):
        # the loader runs the pipeline; plan.json's layouts are those of the single program
        pest = pipe["estimate"]
        if pipe["stages"] > 1:
            shapes = [("x".join(map(str, s["shape"])) if "shape" in s else
                       "x".join(map(str, s["axis_sizes"]))) +
                      f" (devices {device_ranges(s['devices'])})" for s in pipe["submeshes"]]
            lead = (f"Pipeline: {pipe['stages']} stages on submeshes {' + '.join(shapes)}, "
                    f"{pipe['microbatches']} microbatches, {pipe['schedule']} schedule")
        else:
            lead = f"Gradient accumulation over {pipe['microbatches']} microbatches"
        budget = plan.get("memory_budget_bytes")
        over = budget is not None and est.get("peak_memory_bytes", 0) > budget
        text = (f"{lead}: estimated step {fs(pest['step_time_s'])}, peak "
                f"{fb(max(pest['memory_per_stage_bytes']))} per device, bubble "
                f"{pest.get('bubble_fraction', 0.0):.0%}. The single-program plan (the tables "
                f"below; estimated step {fs(est.get('step_time_s', 0.0))}"
                f"{', over the memory budget' if over else ''}): "
                + text[:1].lower() + text[1:])
        return text
    view = plan["mesh"].get("view_of")
    if view:
        text += (f" Planned on the view {_axes_text(plan['mesh'])} of the mesh "
                 f"{_axes_text(view)} (the same devices).")
    text += (f" Estimated step {fs(est.get('step_time_s', 0.0))}, peak "
             f"{fb(est.get('peak_memory_bytes', 0))} per device on "
             f"{plan['device_model'].get('name', '?')}.")
    return text


# -- JSON ----------------------------------------------------------------------------------------


def summary(plan: dict, top: int = 10) -> dict:
    """A machine-readable account of the plan: what it decided, its estimate, and why."""
    memory = memory_breakdown(plan)
    return {
        "ok": True,
        "strategy": strategy_paragraph(plan),
        "parallelism": strategy_phrases(plan),
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
        "selection": plan.get("selection"),
        "diagnostics": plan.get("diagnostics", []),
    }


# -- text ----------------------------------------------------------------------------------------


COMPACT_ROWS = {"arguments": 8, "results": 5, "ops": 5, "decisions": 3}


def render_text(plan: dict, console, top: int | None = None, verbose: bool = False) -> None:
    """Print the report on a rich Console: the strategy in a paragraph, then the tables (their
    largest rows; `verbose`: every row, and the device model and solver details)."""
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

    def more(count: int, what: str) -> None:
        if count > 0:
            console.print(Text(f"  ... and {count} more {what} (--verbose lists all)",
                               style="dim"))

    if top is None:
        top = 10 if verbose else COMPACT_ROWS["ops"]
    est, mesh, device = plan["estimate"], plan["mesh"], plan["device_model"]
    source = plan.get("input", {}) or {}
    console.print(Text(f"hloplan plan for {source.get('file', '?')}: mesh {_mesh_text(plan)} "
                       f"({mesh.get('devices', '?')} devices) on {device.get('name', '?')}",
                       style="bold"))
    console.print(Text(strategy_paragraph(plan)))
    remat = plan.get("rematerialized")
    if remat:  # no plan fit the budget without it
        console.print(Text(f"recomputes {remat['values']} activations after the forward pass "
                           f"({remat['ops']} cheap ops) to fit the memory budget"))
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
    if verbose:
        t = table("Device model", "Model", "Platform", "Memory per device", "Budget per device",
                  right=("Memory per device", "Budget per device"))
        t.add_row(*cells(device.get("name"), device.get("platform"),
                         format_bytes(device["memory_bytes"]) if device.get("memory_bytes")
                         else "?", format_bytes(budget) if budget else "unlimited"))
        console.print(t)

    for title, entries, column, key in (("Arguments", plan["arguments"], "Argument", "arguments"),
                                        ("Results", plan["results"], "Result", "results")):
        shown = list(entries)
        if not verbose:  # the largest, in program order
            keep = sorted(range(len(entries)), key=lambda i: (-entries[i]["bytes"], i))
            shown = [entries[i] for i in sorted(keep[:COMPACT_ROWS[key]])]
            title += f" (the {len(shown)} largest of {len(entries)})" if len(shown) < len(
                entries) else ""
        t = table(title, column, "Type", "PartitionSpec", "Size", "Per device",
                  right=("Size", "Per device"))
        for entry in shown:
            t.add_row(*cells(entry["name"], _type_text(entry), _spec_text(entry["spec"]),
                             format_bytes(entry["bytes"]), format_bytes(entry["bytes_per_device"])))
        console.print(t)
        more(len(entries) - len(shown), key)

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
        for line in memory_check_lines(plan) + selection_lines(plan):
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
        shown = decisions if verbose else decisions[:COMPACT_ROWS["decisions"]]
        for d in shown:
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
        more(len(decisions) - len(shown), "decisions")
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


def pipeline_spans(pipe: dict) -> list[tuple[int, float, float, str, bool]]:
    """(stage, start, end, mark, forward) of every task run, from a simulation of the dispatch
    order with each task taking its estimated time; mark: the microbatch's digit (forward) or
    letter (backward)."""
    tasks = {t["index"]: t for t in pipe["tasks"]}
    stage_free = [0.0] * pipe["stages"]
    done: dict[tuple[int, int], float] = {}
    producer = {v: t["index"] for t in pipe["tasks"] if t["part"] == "A" for v in t["outputs"]}
    spans: list[tuple[int, float, float, str, bool]] = []
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
        forward = task["phase"] == first_phase.get(task["stage"])
        mark = str(m % 10) if forward else "abcdefghij"[m % 10]
        spans.append((task["stage"], ready, end, mark, forward))
    return spans


def pipeline_timeline(pipe: dict, width: int = 60) -> list[str]:
    """One line per stage: which microbatch's forward (digits) or backward (letters) runs when
    (pipeline_spans)."""
    spans = pipeline_spans(pipe)
    total = max((end for _, _, end, _, _ in spans), default=0.0) or 1.0
    lines = []
    for stage in range(pipe["stages"]):
        row = ["."] * width
        for s, start, end, mark, _ in spans:
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
        lines = sorted({_short_location(line) for task in pipe["tasks"]
                        if task["stage"] == stage for line in task.get("source_lines", [])})
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
    """Lines building the plan's mesh over jax.devices(), row-major as hloplan.load builds it
    (a view of the mesh asked for, compiler.plan_on_views, reshapes the same devices in the same
    order, so every device keeps its place)."""
    mesh, view_of = plan["mesh"], plan["mesh"].get("view_of")
    sizes = [int(s) for s in mesh["axis_sizes"]]
    lines = []
    if view_of:
        lines.append(f"# a view of the mesh {_axes_text(view_of)}: the same devices in the "
                     "same order")
    lines += [
        f"devices = np.array(jax.devices()[:{math.prod(sizes)}]).reshape{_tuple_source(sizes)}",
        f"mesh = Mesh(devices, {_tuple_source(mesh['axis_names'])}, "
        f"axis_types=(AxisType.Auto,) * {len(sizes)})",
    ]
    return lines


def jax_source(plan: dict, exported, reference: str | Path | None = None) -> str:
    """Python source that runs as pasted: the plan's mesh over jax.devices(), `in_shardings`
    (the positional arguments' pytree) and `out_shardings` (the results') as NamedShardings,
    and `jit(f)`, jax.jit with them and the export's donation. `reference`: a serialized
    Exported of the original program (a plan directory's reference.jaxexport), jitted as `step`
    so that the code runs end to end; without it the code jits nothing until you call
    `jit(your_function)`."""
    import jax

    in_leaves = [_Spec(partition_spec_text(s)) for s in _flat_specs(exported, "in")]
    out_leaves = [_Spec(partition_spec_text(s)) for s in _flat_specs(exported, "out")]
    args, kwargs = jax.tree.unflatten(exported.in_tree, in_leaves)
    results = jax.tree.unflatten(exported.out_tree, out_leaves)
    source = plan.get("input") or {}
    lines = [
        f"# Shardings planned by hloplan for {source.get('file', 'the program')} on mesh "
        f"{_mesh_text(plan)} ({plan['device_model'].get('name', '?')}).",
        "import jax",
        "import numpy as np",
        "from jax.sharding import AxisType, Mesh, NamedSharding",
        "from jax.sharding import PartitionSpec as P",
        "",
        *_mesh_source(plan),
        "",
        "",
        "def named(tree):",
        "    return jax.tree.map(lambda p: NamedSharding(mesh, p), tree,",
        "                        is_leaf=lambda x: isinstance(x, P))",
        "",
        "",
    ]
    custom: list[str] = []
    try:
        lines.append(f"in_shardings = named({_source(tuple(args))})")
        if kwargs:
            lines.append(f"in_shardings_kwargs = named({_source(dict(kwargs))})")
        lines.append(f"out_shardings = named({_source(results)})")
        custom = sorted(_namedtuple_types((args, kwargs, results), set()))
    except _CustomNode as exc:
        # Custom pytree nodes have no literal syntax: the flat leaves, in pytree order, are
        # rebuilt into the trees with the program's own tree structure.
        lines += [
            f"# The arguments or results contain custom pytree nodes ({exc}): the shardings",
            "# are given flat, in pytree order, for jax.tree.unflatten with your trees' structure.",
            f"in_shardings_flat = named({_source(list(in_leaves))})",
            f"out_shardings_flat = named({_source(list(out_leaves))})",
            "in_shardings = out_shardings = None  # rebuild them from the flat lists",
        ]
    if custom:
        lines.insert(1, "# named tuples used below (import them from your code): "
                     + ", ".join(custom))
    lines += [
        "",
        "",
        "def jit(f):",
        '    """jax.jit of your function (the one exported) with the planned shardings."""',
        "    return jax.jit(f, in_shardings=in_shardings, out_shardings=out_shardings"
        f"{_donate_text(plan, args)})",
    ]
    if reference is not None:
        lines += [
            "",
            "",
            "# The plan's copy of the original program; jit your own function the same way.",
            f"with open({str(reference)!r}, 'rb') as _f:",
            "    step = jit(jax.export.deserialize(bytearray(_f.read())).call)",
        ]
    else:
        lines += ["", "# step = jit(your_function); outputs = step(*args)"]
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
