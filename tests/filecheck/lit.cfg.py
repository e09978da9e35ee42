# lit configuration for hloplan's golden IR tests (one .mlir file per pass, run by
# tests/test_filecheck.py, or by hand: `.venv/bin/lit -v tests/filecheck`).
#
# Substitutions:
#   hloplan-opt     `hloplan opt` from the venv that runs lit (or HLOPLAN_BIN_DIR)
#   filecheck       the `filecheck` PyPI package's FileCheck, from the same venv
#   %split-input    `%split-input %s N` prints chunk N (0-based) of a file whose chunks are
#                   separated by `// -----` lines, other chunks blanked so line numbers (and
#                   [[@LINE]] checks) stay those of the test file
import os
import sys
import tempfile

import lit.formats

config.name = "hloplan-filecheck"  # noqa: F821 (lit injects `config`)
# The internal shell: it knows `not`, pipes and redirections; lit 23 deprecates the external one.
config.test_format = lit.formats.ShTest(execute_external=False)  # noqa: F821
config.suffixes = [".mlir"]  # noqa: F821
config.test_source_root = os.path.dirname(os.path.abspath(__file__))  # noqa: F821
# Keep lit's Output/ scratch directories out of the source tree.
config.test_exec_root = os.environ.get("HLOPLAN_LIT_EXEC_ROOT") or os.path.join(  # noqa: F821
    tempfile.gettempdir(), f"hloplan-filecheck-{os.getuid()}")

bin_dir = os.environ.get("HLOPLAN_BIN_DIR") or os.path.dirname(sys.executable)
tools = {}
for tool in ("hloplan", "filecheck"):
    path = os.path.join(bin_dir, tool)
    if not os.access(path, os.X_OK):
        lit_config.fatal(f"{tool} not found in {bin_dir}: install hloplan with its [test] extra "  # noqa: F821
                         "or set HLOPLAN_BIN_DIR")
    tools[tool] = path

# Substitutions are regular expressions applied in order, before lit's own (%s, %t): match the
# tool names as whole words only, so paths that contain them (tests/filecheck/...) stay intact.
split_input = os.path.join(config.test_source_root, "split_input.py")  # noqa: F821
config.substitutions.append(  # noqa: F821
    (r"(?<![\w/.%-])filecheck(?![\w/.-])", tools["filecheck"]))
config.substitutions.append(  # noqa: F821
    (r"(?<![\w/.%-])hloplan-opt(?![\w/.-])", f"{tools['hloplan']} opt"))
config.substitutions.append(("%split-input", f"{sys.executable} {split_input}"))  # noqa: F821

# `hloplan opt` neither compiles nor runs anything, so XLA needs no flags; keep JAX quiet and
# on the CPU whatever the machine has.
config.environment["JAX_PLATFORMS"] = "cpu"  # noqa: F821
config.environment["PYTHONUNBUFFERED"] = "1"  # noqa: F821
