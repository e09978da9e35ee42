"""`launch` on a hang: the processes still running at the time limit print their stacks first,
so the failure message says where each one waited (no jax needed; about 3 s)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from hloplan.multiprocess import JobFailure, failure_message, launch

HANGS = textwrap.dedent("""
    import faulthandler, signal, sys, time
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    def wait_for_peer():
        time.sleep(60)

    if sys.argv[1] == "0":
        wait_for_peer()
""")


def test_timeout_reports_where_each_running_process_waits(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANGS)
    commands = [[sys.executable, str(script), str(i)] for i in range(2)]
    with pytest.raises(JobFailure) as caught:
        launch(commands, [None, None], timeout=1.5, log_dir=tmp_path / "logs")
    exc = caught.value
    assert exc.reason == "timeout"
    assert [o.returncode for o in exc.outcomes] == [None, 0]  # process 1 had finished
    message = failure_message(exc, 2, 1.5)
    assert "still running: 0)" in message
    assert "process 0 was waiting in (most recent call first):" in message
    stack = message.split("waiting in (most recent call first):\n")[1].splitlines()
    assert "in wait_for_peer" in stack[0] and "in <module>" in stack[1], message
    assert "process 1 was waiting" not in message


def test_timeout_without_a_stack_dump_says_so(tmp_path):
    commands = [[sys.executable, "-c", "import time; time.sleep(60)"]]
    with pytest.raises(JobFailure) as caught:
        launch(commands, [None], timeout=1.0, log_dir=tmp_path / "logs")
    message = failure_message(caught.value, 1, 1.0)
    assert "was waiting in" not in message
    assert "process 0 wrote nothing to stderr" in message
