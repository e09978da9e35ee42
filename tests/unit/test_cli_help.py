"""`hloplan --help` and `hloplan compile --help`: what a new user reads first."""

from click.testing import CliRunner

from hloplan.cli import main
from hloplan.cli_help import COMPILE_GROUPS


def test_compile_help_groups_its_options():
    out = CliRunner().invoke(main, ["compile", "--help"])
    assert out.exit_code == 0, out.output
    text = out.output
    headings = [text.index(f"\n{heading}:\n") for heading in COMPILE_GROUPS]
    assert headings == sorted(headings), "groups out of order"
    # every option of the command is in a group, each once
    compile_command = main.commands["compile"]
    grouped = [name for names in COMPILE_GROUPS.values() for name in names]
    options = {p.name for p in compile_command.params if p.param_type_name == "option"}
    assert set(grouped) == options - {"help"} and len(grouped) == len(set(grouped))
    assert text.index("--mesh") < text.index("Planning:") < text.index("--time-limit")
    assert text.index("Debugging:") < text.index("--print-after")
    assert "without it: the annotated" in text and "MLIR to stdout" in text


def test_opt_is_hidden_but_still_runs(tmp_path):
    out = CliRunner().invoke(main, ["--help"])
    assert out.exit_code == 0
    commands = out.output.split("Commands:")[1]
    assert "compile" in commands and "explain" in commands and "run" in commands
    assert "opt" not in commands.split()
    assert CliRunner().invoke(main, ["opt", "--help"]).exit_code == 0
