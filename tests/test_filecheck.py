"""Golden IR tests: every tests/filecheck/*.mlir is a lit test whose RUN lines drive `hloplan opt`
and check its output (stdout and diagnostics) with FileCheck. One pytest item per file.

A file marked `// XFAIL: *` documents a known bug: lit reports it as an expected failure (the
item shows as xfailed here) and as an unexpected pass once the bug is fixed (the item fails: drop
the XFAIL line). Run one by hand with `.venv/bin/lit -v tests/filecheck/<pass>.mlir`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

FILECHECK_DIR = Path(__file__).resolve().parent / "filecheck"
# lit is a console script next to the interpreter (`python -m lit` has no __main__).
BIN_DIR = Path(sys.executable).parent
LIT = BIN_DIR / "lit"
TESTS = sorted(FILECHECK_DIR.glob("*.mlir"))
TIMEOUT_S = 300


@pytest.fixture(scope="session")
def lit_exec_root(tmp_path_factory) -> Path:
    """Where lit keeps its Output/ scratch files (%t) and test times: not the source tree."""
    return tmp_path_factory.mktemp("lit")


def test_filecheck_suite_is_found():
    assert (FILECHECK_DIR / "lit.cfg.py").is_file()
    assert TESTS, f"no .mlir tests in {FILECHECK_DIR}"


@pytest.mark.parametrize("test", TESTS, ids=[t.name for t in TESTS])
def test_filecheck(test: Path, lit_exec_root: Path):
    if not os.access(LIT, os.X_OK):
        pytest.fail(f"{LIT} not found: install the test extra (pip install -e '.[test]')")
    env = dict(os.environ, HLOPLAN_BIN_DIR=str(BIN_DIR), HLOPLAN_LIT_EXEC_ROOT=str(lit_exec_root))
    proc = subprocess.run([str(LIT), "-v", "--no-progress-bar", str(test)], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"lit failed on {test.name}:\n{output}"
    status = re.search(rf"^(PASS|XFAIL|UNSUPPORTED|XPASS|FAIL): .* :: {re.escape(test.name)} ",
                       output, re.MULTILINE)
    assert status is not None, f"lit ran no test for {test.name}:\n{output}"
    if status.group(1) == "XFAIL":
        pytest.xfail(_known_bug(test))
    assert status.group(1) == "PASS", f"lit reported {status.group(1)} for {test.name}:\n{output}"


def _known_bug(test: Path) -> str:
    """The first sentence of the comment that follows `// XFAIL: *`."""
    lines = []
    for line in test.read_text().splitlines()[1:]:
        if not line.startswith("//") or "RUN:" in line:
            break
        lines.append(line.lstrip("/ ").strip())
    text = " ".join(lines)
    return text.split(". ")[0] if text else "known bug"
