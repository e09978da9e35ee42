"""The README's runnable code blocks run as written.

Every fenced ```python or ```sh block preceded by a `<!-- runnable -->` line is run, in README
order, in one temporary directory (a later block may use the files an earlier one wrote), with
the `hloplan` command of this environment on PATH. The python blocks, pasted one after another
into a file, make one script: they are also run that way, as the README says they can be.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hloplan

README = Path(__file__).resolve().parents[2] / "README.md"
MARK = "<!-- runnable -->"
BLOCK = re.compile(r"^" + re.escape(MARK) + r"\n```(python|sh)\n(.*?)^```$", re.M | re.S)
TIMEOUT_S = 600


def runnable_blocks(text: str) -> list[tuple[str, str]]:
    return [(lang, body) for lang, body in BLOCK.findall(text)]


def _needs_missing_api(body: str) -> bool:
    # hloplan.shard (the in-process API) ships separately; its blocks run once it is there.
    return "hloplan.shard(" in body and not hasattr(hloplan, "shard")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the blocks set their own
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["MPLBACKEND"] = "Agg"
    return env


def _run(args: list[str], cwd: Path, what: str) -> None:
    proc = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, (f"{what} failed (exit {proc.returncode}):\n"
                                  f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")


def test_readme_marks_blocks_and_stays_small():
    text = README.read_text()
    blocks = runnable_blocks(text)
    assert len(blocks) >= 3, "the README's runnable blocks are not found"
    assert sum(lang == "python" for lang, _ in blocks) >= 2
    assert len(text.encode()) < 12 * 1024, "README.md must stay under 12 KB"
    # every python/sh block is either runnable or a short command listing (install, options)
    for lang, body in re.findall(r"```(python)\n(.*?)^```$", text, re.M | re.S):
        assert (lang, body) in blocks, f"a python block is not marked runnable:\n{body[:200]}"


def test_readme_blocks_run(tmp_path):
    blocks = runnable_blocks(README.read_text())
    skipped = []
    for index, (lang, body) in enumerate(blocks):
        if _needs_missing_api(body):
            skipped.append(index)
            continue
        script = tmp_path / f"block{index}.{'py' if lang == 'python' else 'sh'}"
        script.write_text(body)
        if lang == "python":
            _run([sys.executable, script.name], tmp_path, f"README block {index} (python)")
        else:
            _run(["bash", "-euo", "pipefail", script.name], tmp_path,
                 f"README block {index} (sh)")
    if skipped:
        pytest.skip(f"blocks {skipped} need hloplan.shard, which this build lacks")


def test_readme_python_blocks_run_as_one_file(tmp_path):
    python = [body for lang, body in runnable_blocks(README.read_text()) if lang == "python"]
    kept = [body for body in python if not _needs_missing_api(body)]
    script = tmp_path / "quickstart.py"
    script.write_text("\n".join(kept))
    _run([sys.executable, script.name], tmp_path, "the README's python blocks as one file")
    if len(kept) < len(python):
        pytest.skip(f"{len(python) - len(kept)} python blocks need hloplan.shard, which this "
                    "build lacks; the others ran as one file")
