"""`--help` with options in named groups (click lists them flat)."""

from __future__ import annotations

import click

# compile's options by group, in the order `hloplan compile --help` shows them
COMPILE_GROUPS = {
    "Input and target": ["mesh", "device", "hosts", "memory_budget"],
    "Planning": ["time_limit", "solver", "gap", "decompose", "mesh_views", "donate",
                 "verify_memory", "select", "pass_options"],
    "Pipelines and microbatches": ["stages", "microbatches", "schedule", "batch_args"],
    "Output": ["output", "fmt", "quiet"],
    "Debugging": ["print_after", "time_passes", "reproducer"],
}


class GroupedCommand(click.Command):
    """A command whose --help lists its options under the headings of `groups`
    (heading -> parameter names); options in no group are listed last, under 'Other'."""

    def __init__(self, *args, groups: dict[str, list[str]] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.groups = groups or {}

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records = {}
        for param in self.get_params(ctx):
            if not isinstance(param, click.Option):
                continue
            record = param.get_help_record(ctx)
            if record is not None:
                records[param.name] = record
        placed: set[str] = set()
        for heading, names in self.groups.items():
            rows = [records[name] for name in names if name in records]
            placed.update(names)
            if rows:
                with formatter.section(heading):
                    formatter.write_dl(rows)
        rest = [record for name, record in records.items() if name not in placed]
        if rest:
            with formatter.section("Other"):
                formatter.write_dl(rest)
