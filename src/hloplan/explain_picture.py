"""The picture of a plan (`hloplan explain --svg/--png`), drawn with matplotlib.

- the mesh, one cell per device (rows: the first mesh axis; columns: the others), and in
  each cell a miniature of the batch and of the largest parameters with the block that device
  holds filled in: a data-parallel batch shows one band of rows per device group, a weight
  sharded over both axes a different tile in every cell;
- for a pipeline, each stage's devices framed in its colour, and the schedule: which
  microbatch's forward and backward each stage runs when (the simulation `explain` prints);
- the estimated step time split and the peak memory against the budget.

Everything is read from plan.json, so a plan directory and a plan made in memory draw the same.
"""

from __future__ import annotations

import math
import textwrap

from hloplan.decisions import partition_spec_text
from hloplan.explain_report import argument_roles, charts, pipeline_spans, strategy_paragraph
from hloplan.units import format_bytes

MAX_CELLS = 64  # larger meshes draw their first rows and columns
TENSOR_COLORS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2")
STAGE_COLORS = ("#e45756", "#72b7b2", "#eeca3b", "#9d755d", "#ff9da6", "#bab0ac")


def _shown_tensors(plan: dict, count: int = 3) -> list[dict]:
    """The largest batch input, then the largest parameters (or arguments) that fill `count`."""
    args = plan["arguments"]
    roles = argument_roles(plan)
    chosen = []
    batch = sorted(roles["batch"], key=lambda i: -args[i]["bytes"])
    if batch:
        chosen.append(("batch", args[batch[0]]))
    pool = roles["params"] or list(range(len(args)))
    for i in sorted(pool, key=lambda i: (-args[i]["bytes"], i)):
        if len(chosen) >= count:
            break
        if args[i]["shape"] and all(args[i] is not c for _, c in chosen):
            chosen.append(("parameter", args[i]))
    return [dict(entry, role=role) for role, entry in chosen]


def _block(entry: dict, dim: int, coords: dict, sizes: dict) -> tuple[int, int]:
    """(index, count) of the block of `dim` a device at `coords` holds (axes major to minor)."""
    spec = entry.get("spec") or []
    axes = spec[dim] if dim < len(spec) else []
    index, count = 0, 1
    for axis in axes:
        index = index * int(sizes[axis]) + coords[axis]
        count *= int(sizes[axis])
    return index, count


def _device_coords(names: list[str], sizes: list[int], device: int) -> dict:
    coords = {}
    for name, size in zip(reversed(names), reversed(sizes)):
        coords[name] = device % int(size)
        device //= int(size)
    return coords


def _draw_mini(ax, x, y, w, h, entry: dict, coords: dict, sizes: dict, color: str) -> None:
    """A tensor as a rectangle (rows: dim 0, columns: the last dim) with this device's block."""
    from matplotlib.patches import Rectangle

    shape = entry["shape"]
    ax.add_patch(Rectangle((x, y), w, h, facecolor="white", edgecolor="#999999", lw=0.5))
    rank = len(shape)
    if rank == 0:
        ax.add_patch(Rectangle((x, y), w, h, facecolor=color, lw=0))
        return
    row_dim, col_dim = (0, rank - 1) if rank >= 2 else (None, 0)
    r_index, r_count = _block(entry, row_dim, coords, sizes) if row_dim is not None else (0, 1)
    c_index, c_count = _block(entry, col_dim, coords, sizes)
    # middle dims of rank-3+ tensors: their split thins the block
    thin = math.prod(_block(entry, d, coords, sizes)[1] for d in range(1, rank - 1))
    bw, bh = w / c_count, h / r_count
    ax.add_patch(Rectangle((x + c_index * bw, y + h - (r_index + 1) * bh), bw, bh / thin,
                           facecolor=color, lw=0))


def _stage_of(plan: dict) -> dict[int, int]:
    pipe = plan.get("pipeline") or {}
    if not pipe.get("tasks") or pipe.get("stages", 1) < 2:
        return {}
    return {d: s for s, sub in enumerate(pipe.get("submeshes") or []) for d in sub["devices"]}


def figure(plan: dict):
    """The matplotlib Figure of the plan."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    mesh = plan["mesh"]
    names, sizes = list(mesh["axis_names"]), [int(s) for s in mesh["axis_sizes"]]
    by_name = dict(zip(names, sizes))
    rows = sizes[0] if len(sizes) > 1 else 1
    cols = math.prod(sizes[1:]) if len(sizes) > 1 else sizes[0]
    shown_rows, shown_cols = min(rows, 8), min(cols, MAX_CELLS // min(rows, 8))
    tensors = _shown_tensors(plan)
    stages = _stage_of(plan)
    pipe = plan.get("pipeline") or {}
    spans = pipeline_spans(pipe) if stages else []

    cell_w, cell = 0.25 + 0.55 * max(len(tensors), 1), 1.0
    mesh_w = shown_cols * cell_w
    fig_w = max(mesh_w + 4.5, 10.0)
    mesh_h = shown_rows * cell
    heights = [1.3, mesh_h + 0.6, 0.4 + 0.28 * len(tensors)]
    if spans:
        heights.append(0.5 + 0.3 * pipe["stages"])
    heights.append(0.5 + 0.22 * (len(charts(plan)[0].rows) + 2))
    fig = plt.figure(figsize=(fig_w, sum(heights)))
    grid = fig.add_gridspec(len(heights), 1, height_ratios=heights, hspace=0.35)
    source = (plan.get("input") or {}).get("file", "plan")
    axis_text = ", ".join(f"{n}={s}" for n, s in zip(names, sizes))

    ax = fig.add_subplot(grid[0])
    ax.axis("off")
    ax.text(0, 1, f"hloplan: {source} on mesh {axis_text} ({plan['device_model'].get('name')})",
            fontsize=13, weight="bold", va="top", transform=ax.transAxes)
    ax.text(0, 0.62, "\n".join(textwrap.wrap(strategy_paragraph(plan), int(fig_w * 15))),
            fontsize=9, va="top", transform=ax.transAxes)

    ax = fig.add_subplot(grid[1])
    ax.set_xlim(-1.2, fig_w - 1.2)
    ax.set_ylim(-0.5, mesh_h + 0.1)
    ax.set_aspect("equal")
    ax.axis("off")
    slot = (cell_w - 0.2) / max(len(tensors), 1)
    for r in range(shown_rows):
        for c in range(shown_cols):
            device = r * cols + c
            coords = _device_coords(names, sizes, device)
            x0, y0 = c * cell_w, mesh_h - (r + 1) * cell
            edge = STAGE_COLORS[stages[device] % len(STAGE_COLORS)] if device in stages else "#444"
            ax.add_patch(Rectangle((x0 + 0.04, y0 + 0.04), cell_w - 0.08, cell - 0.08,
                                   facecolor="#f7f7f7", edgecolor=edge,
                                   lw=2.5 if device in stages else 0.8))
            ax.text(x0 + 0.08, y0 + cell - 0.1, str(device), fontsize=6, va="top")
            for k, entry in enumerate(tensors):
                _draw_mini(ax, x0 + 0.12 + k * slot, y0 + 0.12, slot - 0.1, cell - 0.36,
                           entry, coords, by_name, TENSOR_COLORS[k % len(TENSOR_COLORS)])
    row_axis = names[0] if len(names) > 1 else ""
    col_axes = ", ".join(names[1:]) if len(names) > 1 else names[0]
    ax.text(shown_cols * cell_w / 2, -0.3, f"axis {col_axes} \u2192", ha="center", fontsize=9)
    if row_axis:
        ax.text(-0.15, mesh_h / 2, f"axis {row_axis}\n\u2193", va="center", ha="right",
                fontsize=9)
    if (shown_rows, shown_cols) != (rows, cols):
        ax.text(shown_cols * cell_w + 0.2, 0, f"(devices of the first {shown_rows} x {shown_cols} "
                f"of {rows} x {cols} shown)", fontsize=8, color="#666")
    if stages:
        for s, sub in enumerate(pipe.get("submeshes") or []):
            ax.text(shown_cols * cell_w + 0.3, mesh_h - 0.3 - 0.3 * s,
                    f"stage {s}: devices {min(sub['devices'])}-{max(sub['devices'])}",
                    color=STAGE_COLORS[s % len(STAGE_COLORS)], fontsize=9, weight="bold")

    ax = fig.add_subplot(grid[2])
    ax.axis("off")
    single = " (in the single-program plan)" if pipe.get("tasks") else ""
    ax.text(0, 1, "Each device holds the filled block of (rows: dim 0, columns: the last dim)"
            f"{single}:",
            fontsize=9, va="top", transform=ax.transAxes)
    for k, entry in enumerate(tensors):
        y = 1 - (k + 1.2) / (len(tensors) + 1.2)
        ax.add_patch(Rectangle((0.0, y - 0.05), 0.015, 0.14, transform=ax.transAxes,
                               facecolor=TENSOR_COLORS[k % len(TENSOR_COLORS)]))
        ax.text(0.025, y, f"{entry['role']} {entry['name']}: {entry['dtype']}"
                f"[{','.join(map(str, entry['shape']))}] {partition_spec_text(entry['spec'])}, "
                f"{format_bytes(entry['bytes_per_device'])} per device", fontsize=9,
                va="center", transform=ax.transAxes)

    panel = 3
    if spans:
        ax = fig.add_subplot(grid[panel])
        panel += 1
        total = max(end for _, _, end, _, _ in spans) or 1.0
        for stage, start, end, mark, forward in spans:
            ax.barh(stage, (end - start) / total, left=start / total, height=0.7,
                    color=STAGE_COLORS[stage % len(STAGE_COLORS)], alpha=1.0 if forward else 0.55,
                    edgecolor="white", lw=0.5)
            if (end - start) / total > 0.02:
                ax.text((start + end) / 2 / total, stage, mark, ha="center", va="center",
                        fontsize=7)
        ax.set_yticks(range(pipe["stages"]), [f"stage {s}" for s in range(pipe["stages"])])
        ax.invert_yaxis()
        ax.set_xticks([])
        ax.set_title(f"Schedule ({pipe.get('schedule')}, {pipe.get('microbatches')} microbatches;"
                     " digits: forward of microbatch m, letters: its backward)",
                     fontsize=9, loc="left")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)

    ax = fig.add_subplot(grid[panel])
    time_chart = charts(plan)[0]
    labels = [label for label, _, _ in time_chart.rows]
    ax.barh(range(len(labels)), [fraction for _, fraction, _ in time_chart.rows],
            color=TENSOR_COLORS[0])
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.6)
    ax.set_xticks([])
    for i, (_, fraction, value) in enumerate(time_chart.rows):
        ax.text(fraction + 0.02, i, value, va="center", fontsize=8)
    memory = charts(plan)[1].rows[0][2]
    ax.set_title(f"{time_chart.title}; peak memory {memory}", fontsize=9, loc="left")
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    return fig


def write(plan: dict, path: str, kind: str) -> None:
    """Write the picture to `path` as 'svg' or 'png'."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "hloplan"}):
        fig = figure(plan)
        try:
            fig.savefig(path, format=kind, dpi=110, bbox_inches="tight",
                        metadata={"Date": None} if kind == "svg" else None)
        finally:
            plt.close(fig)
