"""`hloplan run --processes N`: run a plan as one `jax.distributed` job of N local processes.

The parent (this module, imported by the CLI; it does not import jax) picks a free loopback
port, starts N workers (`python -m hloplan.multiprocess worker ...`), each with
`XLA_FLAGS=--xla_force_host_platform_device_count=<mesh devices / N>` and `JAX_PLATFORMS=cpu`,
and waits for them under a time limit.  Each worker calls `jax.distributed.initialize` on
`127.0.0.1:PORT`, runs `hloplan.check.check_plan` (same seeded inputs in every process, its own
shards placed from them, the reference run on one of its own devices, its own shards of the
results compared) and writes its report as JSON.  The parent merges the reports into the
single-process report format.

Failure handling: when a worker exits with an error, or the time limit passes, the parent kills
every worker it started (each runs in its own process group) and raises an error that names the
process and quotes the end of its stderr.  Independently of the parent, the workers use
jax.distributed's own health checks: a short heartbeat timeout makes the survivors of a dead
peer abort instead of waiting in a collective, and each worker exits when its parent is gone or
its own deadline passes, so nothing is left running.

`launch` (N commands with their environments, one time limit, the same clean-up) is public: the
tests use it to start the plan's own `run_distributed.py` on loopback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from hloplan.diagnostics import HloplanError, UsageError

DEVICE_FLAG = "--xla_force_host_platform_device_count"
KILL_ENV = "HLOPLAN_TEST_KILL_PROCESS"  # testing: this process id exits(3) right after initialize
HEARTBEAT_TIMEOUT_S = 10  # loopback: a peer silent this long is dead (jax's default is 100 s)
STDERR_TAIL_LINES = 12
# A worker that registered faulthandler for this signal prints every thread's Python stack to its
# stderr; the parent sends it to workers still running at the time limit, so a hang says where.
STACK_DUMP_SIGNAL = signal.SIGUSR1
STACK_DUMP_WAIT_S = 1.0
STACK_LINES = 16
# stderr lines of a process that aborted because *another* process died (not the first cause)
_SECONDARY = re.compile(r"another task died|tasks are unhealthy|detected fatal errors|"
                        r"Gloo.*(Connection closed|Read error|Connection reset)", re.I)
_NOISE = re.compile(r"^\[Gloo\] Rank \d+ is connected to|preemption_notifier.*SIGTERM caught")


# --------------------------------------------------------------------------- launching


def free_port() -> int:
    """A TCP port free on the loopback interface now (the coordinator binds it shortly after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def isolated_python(module: str) -> list[str]:
    """The command that runs `python -m module` in isolated mode (-I): neither the working
    directory, nor PYTHONPATH, nor user site-packages comes onto sys.path, so a json.py or an
    hloplan/ in the directory a user runs from (a plan directory, say) is never imported. The
    directory this process imported hloplan from is appended after the standard library and
    the installed packages, so the worker runs the same hloplan."""
    import hloplan

    root = str(Path(hloplan.__file__).resolve().parents[1])
    boot = (f"import sys; sys.path.append({root!r}); import runpy; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-I", "-u", "-c", boot]


def cpu_worker_env(devices_per_process: int, base: dict | None = None) -> dict:
    """The environment of a loopback worker: `devices_per_process` simulated CPU devices."""
    env = dict(os.environ if base is None else base)
    flags = re.sub(rf"{DEVICE_FLAG}=\S*", "", env.get("XLA_FLAGS", "")).split()
    env["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_FLAG}={devices_per_process}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                 "JAX_LOCAL_DEVICE_IDS", "JAX_COORDINATOR_PORT"):
        env.pop(name, None)
    return env


@dataclass
class ProcessOutcome:
    index: int
    returncode: int | None  # None: still running when the job was stopped
    stdout: Path
    stderr: Path

    def stderr_tail(self, lines: int = STDERR_TAIL_LINES) -> list[str]:
        try:
            text = self.stderr.read_text(errors="replace")
        except OSError:
            return []
        kept = [line for line in text.splitlines() if line.strip() and not _NOISE.match(line)]
        return kept[-lines:]

    def main_stack(self, lines: int = STACK_LINES) -> list[str]:
        """The main thread's Python stack (most recent call first) from the last faulthandler
        dump in its stderr: the dumped thread that runs a script's or module's <module>."""
        try:
            text = self.stderr.read_text(errors="replace")
        except OSError:
            return []
        blocks, current = [], None
        for line in text.splitlines():
            if line.endswith("(most recent call first):"):
                current = []
                blocks.append(current)
            elif current is not None and line.startswith("  File "):
                current.append(line.strip())
            else:
                current = None
        main = [b for b in blocks if any(line.endswith("in <module>") for line in b)]
        return main[-1][:lines] if main else []

    @property
    def secondary(self) -> bool:
        """Its stderr says it failed because another process died."""
        return any(_SECONDARY.search(line) for line in self.stderr_tail(200))


@dataclass
class JobFailure(Exception):
    reason: str  # "died" | "timeout"
    failed: ProcessOutcome | None
    outcomes: list[ProcessOutcome] = field(default_factory=list)
    seconds: float = 0.0
    log_dir: Path | None = None


def _describe_status(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _stop(procs: list[subprocess.Popen], grace_s: float = 0.5) -> None:
    """Terminate the process groups of the workers we started (each leads its own group).
    jax's preemption notifier catches SIGTERM, so SIGKILL follows after a short grace."""
    alive = [p for p in procs if p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in alive:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace_s
        for proc in alive:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                pass
        alive = [p for p in alive if p.poll() is None]
        if not alive:
            break
    for proc in procs:  # reap whatever a SIGKILL left
        try:
            proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass


def _dump_stacks(procs: list[subprocess.Popen]) -> None:
    """Ask the workers still running to print their stacks (see STACK_DUMP_SIGNAL) and give
    them a moment to write them."""
    alive = [p for p in procs if p.poll() is None]
    for proc in alive:
        try:
            os.kill(proc.pid, STACK_DUMP_SIGNAL)
        except (ProcessLookupError, PermissionError):
            pass
    if alive:
        time.sleep(STACK_DUMP_WAIT_S)


def register_stack_dump() -> None:
    """In a worker: print every thread's stack to stderr on STACK_DUMP_SIGNAL."""
    import faulthandler

    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)


def launch(commands: list[list[str]], envs: list[dict], *, timeout: float, log_dir: Path,
           cwd: str | None = None, poll_s: float = 0.05) -> tuple[list[ProcessOutcome], float]:
    """Start one process per command, wait until all exit 0; raise JobFailure as soon as one
    exits non-zero or `timeout` seconds pass, after killing every process still running."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    outcomes: list[ProcessOutcome] = []
    started = time.monotonic()
    try:
        for i, (argv, env) in enumerate(zip(commands, envs)):
            out, err = log_dir / f"process{i}.stdout", log_dir / f"process{i}.stderr"
            with open(out, "wb") as fout, open(err, "wb") as ferr:
                procs.append(subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                              stdout=fout, stderr=ferr, start_new_session=True))
            outcomes.append(ProcessOutcome(i, None, out, err))
        while True:
            codes = [p.poll() for p in procs]
            for outcome, code in zip(outcomes, codes):
                outcome.returncode = code
            failed = [o for o in outcomes if o.returncode not in (None, 0)]
            if failed:
                _stop(procs)  # outcomes keep None for the processes we stopped
                first = sorted(failed, key=lambda o: (o.secondary, o.index))[0]
                raise JobFailure("died", first, outcomes, time.monotonic() - started, log_dir)
            if all(code == 0 for code in codes):
                return outcomes, time.monotonic() - started
            if time.monotonic() - started > timeout:
                _dump_stacks(procs)
                _stop(procs)
                running = next((o for o in outcomes if o.returncode is None), None)
                raise JobFailure("timeout", running, outcomes, time.monotonic() - started, log_dir)
            time.sleep(poll_s)
    except BaseException:
        _stop(procs)
        raise


def failure_message(exc: JobFailure, processes: int, timeout: float) -> str:
    if exc.reason == "timeout":
        running = [o.index for o in exc.outcomes if o.returncode is None]
        head = (f"the {processes}-process run did not finish within {timeout:g} s (--timeout); "
                f"stopped all {processes} processes (still running: "
                f"{', '.join(map(str, running)) or 'none'})")
    else:
        head = (f"process {exc.failed.index} of {processes} {_describe_status(exc.failed.returncode)} "
                f"after {exc.seconds:.1f} s; stopped the other processes")
    lines = [head]
    if exc.reason == "timeout":
        for outcome in exc.outcomes:
            stack = outcome.main_stack() if outcome.returncode is None else []
            if stack:
                lines.append(f"process {outcome.index} was waiting in (most recent call first):")
                lines.extend("  | " + line for line in stack)
    # A timed-out process whose stack is shown above: the rest of its dump is other threads.
    if exc.failed is not None and not (exc.reason == "timeout" and exc.failed.main_stack()):
        tail = exc.failed.stderr_tail()
        lines.append(f"last lines of process {exc.failed.index}'s stderr:" if tail
                     else f"process {exc.failed.index} wrote nothing to stderr")
        lines.extend("  | " + line for line in tail)
    if exc.log_dir is not None:
        lines.append(f"logs of every process: {exc.log_dir}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- hloplan run --processes


def run_plan_processes(plan_dir: str, processes: int, *, inputs: str | None = None, seed: int = 0,
                       rtol: float = 1e-4, atol: float = 1e-5, compare: bool = True,
                       timeout: float = 300.0, placement: str = "global") -> dict:
    """Run (and check) the plan as a jax.distributed job of `processes` local CPU processes;
    the merged report (hloplan.check.format_report prints it)."""
    from hloplan.emit.loader import PlanLoadError, read_plan

    try:
        plan = read_plan(plan_dir)
    except PlanLoadError as exc:
        raise UsageError(str(exc)) from None
    devices = 1
    for size in plan["mesh"]["axis_sizes"]:
        devices *= int(size)
    if processes < 1 or devices % processes:
        raise UsageError(f"--processes {processes} does not divide the {devices} devices of the "
                         f"plan's mesh")
    if timeout <= 0:
        raise UsageError("--timeout must be positive")
    port = free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="hloplan-run-"))
    commands, envs = [], []
    env = cpu_worker_env(devices // processes)
    for i in range(processes):
        argv = [*isolated_python("hloplan.multiprocess"), "worker", str(Path(plan_dir).resolve()),
                "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
                "--process-id", str(i), "--report", str(log_dir / f"report{i}.json"),
                "--seed", str(seed), "--rtol", repr(rtol), "--atol", repr(atol),
                "--placement", placement, "--deadline", repr(timeout + 30.0)]
        if inputs:
            argv += ["--inputs", str(Path(inputs).resolve())]
        if not compare:
            argv.append("--no-compare")
        commands.append(argv)
        envs.append(env)
    try:
        outcomes, seconds = launch(commands, envs, timeout=timeout, log_dir=log_dir,
                                   cwd=str(log_dir))
    except JobFailure as exc:
        error = _worker_error(exc, log_dir)
        if error is not None:  # a worker reported an hloplan error (bad inputs, unsupported plan)
            raise HloplanError(error["message"], exit_code=error["exit_code"]) from None
        raise HloplanError(failure_message(exc, processes, timeout)) from None
    reports = []
    for i in range(processes):
        path = log_dir / f"report{i}.json"
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            raise HloplanError(f"process {i} exited normally but wrote no report ({path}); "
                               f"logs in {log_dir}") from None
    shutil.rmtree(log_dir, ignore_errors=True)
    merged = merge_reports(reports, seconds)
    merged["plan"] = str(plan_dir)
    mesh = plan["mesh"]
    merged["planned_hosts"] = mesh.get("hosts")
    if mesh.get("links"):
        merged["planned_links"] = dict(zip(mesh["axis_names"], mesh["links"]))
    return merged


def _worker_error(exc: JobFailure, log_dir: Path) -> dict | None:
    if exc.failed is None:
        return None
    try:
        report = json.loads((log_dir / f"report{exc.failed.index}.json").read_text())
    except (OSError, ValueError):
        return None
    if "error" not in report:
        return None
    return {"message": f"process {exc.failed.index}: {report['error']}",
            "exit_code": int(report.get("exit_code", 1))}


def merge_reports(reports: list[dict], seconds: float | None = None) -> dict:
    """One report from the per-process ones: verdict over all, compiled stats of process 0."""
    merged = {key: value for key, value in reports[0].items()
              if key not in ("process", "local_devices", "match", "max_abs_error", "differing")}
    merged["processes"] = len(reports)
    per_process = []
    for i, report in enumerate(reports):
        entry = {"process": report.get("process", i),
                 "local_devices": report.get("local_devices", report["devices"])}
        if "match" in report:
            entry.update(match=report["match"], max_abs_error=report["max_abs_error"])
        per_process.append(entry)
    merged["per_process"] = per_process
    if all("match" in report for report in reports):
        merged["match"] = all(report["match"] for report in reports)
        merged["max_abs_error"] = max(report["max_abs_error"] for report in reports)
        worst: dict[str, float] = {}  # each differing result, its largest error in any process
        for report in reports:
            for entry in report.get("differing", []):
                worst[entry["leaf"]] = max(worst.get(entry["leaf"], 0.0), entry["max_abs_error"])
        merged["differing"] = [{"leaf": leaf, "max_abs_error": error}
                               for leaf, error in worst.items()]
    if seconds is not None:
        merged["wall_s"] = round(seconds, 3)
    return merged


# --------------------------------------------------------------------------- the worker


def _watchdog(deadline_s: float) -> None:
    """Exit when the parent is gone (re-parented) or the deadline passes: never linger."""
    import threading

    parent = os.getppid()
    stop_at = time.monotonic() + deadline_s

    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(125)
            if time.monotonic() > stop_at:
                sys.stderr.write(f"hloplan worker: deadline of {deadline_s:g} s passed\n")
                sys.stderr.flush()
                os._exit(124)

    threading.Thread(target=watch, name="hloplan-watchdog", daemon=True).start()


def _write_json(path: str, payload: dict) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=True))
    os.replace(tmp, path)


def worker_main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hloplan.multiprocess worker")
    parser.add_argument("plan_dir")
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--inputs", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--atol", type=float, default=1e-5)
    parser.add_argument("--no-compare", action="store_true")
    parser.add_argument("--placement", default="global", choices=["global", "local"])
    parser.add_argument("--deadline", type=float, default=330.0)
    args = parser.parse_args(argv)
    _watchdog(args.deadline)
    register_stack_dump()

    import jax

    started = time.monotonic()
    jax.distributed.initialize(
        coordinator_address=args.coordinator, num_processes=args.num_processes,
        process_id=args.process_id, coordinator_bind_address=args.coordinator,
        cluster_detection_method="deactivate",
        initialization_timeout=int(max(10, min(args.deadline, 300))),
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
        shutdown_timeout_seconds=int(max(10, min(args.deadline, 60))))
    if os.environ.get(KILL_ENV) == str(args.process_id):
        sys.stderr.write(f"hloplan worker: {KILL_ENV}={args.process_id}: process "
                         f"{args.process_id} exits(3) right after jax.distributed.initialize\n")
        sys.stderr.flush()
        os._exit(3)

    from hloplan.check import check_plan

    try:
        report = check_plan(args.plan_dir, inputs=args.inputs, seed=args.seed, rtol=args.rtol,
                            atol=args.atol, compare=not args.no_compare, placement=args.placement)
    except HloplanError as exc:
        message = "; ".join(d.message for d in exc.diagnostics) or str(exc)
        _write_json(args.report, {"error": message, "exit_code": exc.exit_code})
        sys.stderr.write(f"hloplan worker {args.process_id}: error: {message}\n")
        sys.stderr.flush()
        os._exit(exc.exit_code)  # skip the shutdown barrier: the others are stopped anyway
    report["wall_s"] = round(time.monotonic() - started, 3)
    _write_json(args.report, report)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "worker":
        sys.stderr.write("usage: python -m hloplan.multiprocess worker PLAN_DIR ... "
                         "(started by `hloplan run --processes N`)\n")
        return 2
    return worker_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
