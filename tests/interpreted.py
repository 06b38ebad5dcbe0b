"""Kernel tests without a GPU: run test code in a child Python under Triton's interpreter.

TRITON_INTERPRET=1 must be set before triton is first imported, so the test process (which may have
imported it already) cannot switch; each kernel test hands its comparison to a child instead. The timeout
is generous: the interpreter is slow, and slower still on a loaded machine.

The children are queued when collection ends (`start_early`, called by conftest for the tests a module
names in INTERPRETED_EARLY; conftest also moves those modules to the end of the run) and run one at a
time, in collection order, on the machine's other core while the suite goes on; `run_interpreted`
collects a child already under way (or starts a queued one at once). Children nobody collected are
killed at the end of the session (`stop_unused`). A kernel test names its child there rather than
running it inline: inline, the suite waits for it.

The queue's children are forked from one server process that imported torch and triton once (FORK_SERVER):
each fork runs its script as `python -c` would, with its own stdout and stderr, and exits, so what a
script patches (tile constants, the interpreter's casts) dies with it; the ~1.5 s import is paid once for
the whole queue instead of once a child. The server runs nothing itself (no torch op: no threads to fork).
Every child runs under `fast_interpreter.patch()` (Triton's interpreter without its repeated language patch).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

CHILD_TIMEOUT_S = 1200
# one thread each: a child runs beside the suite, and spinning OpenMP pools of several processes on two
# cores slow everything down many times over
CHILD_ENV = {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# every child's first line: Triton's interpreter with one language patch per helper (see fast_interpreter)
FAST_INTERPRETER = "import fast_interpreter; fast_interpreter.patch()\n"

# reads requests [script, argv, stdout path, stderr path] a line each; answers the fork's pid, then its
# exit code (as subprocess reports it: -signal when killed)
FORK_SERVER = """
import json, os, sys, traceback
import torch, triton, triton.language  # (imported, not used: the fixed cost each fork skips)
""" + FAST_INTERPRETER + """
for line in sys.stdin:
    script, argv, out_path, err_path = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.dup2(os.open(out_path, os.O_WRONLY), 1)
            os.dup2(os.open(err_path, os.O_WRONLY), 2)
            sys.stdin = open(os.devnull)
            sys.argv = ["-c", *argv]
            exec(compile(script, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""

_started: dict[tuple[str, tuple[str, ...]], tuple[subprocess.Popen, object, object]] = {}
_queued: list[tuple[str, tuple[str, ...]]] = []
_runner: threading.Thread | None = None  # the one thread that runs the queue, while it has work
_lock = threading.Lock()


def _spawn(script: str, argv: tuple[str, ...]):
    # files, not pipes: a chatty child never blocks; the collector closes them
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-c", FAST_INTERPRETER + script, *argv],
        cwd=Path(__file__).parent, env={**os.environ, **CHILD_ENV},
        stdout=out, stderr=err, text=True,
    )
    return process, out, err


class _ForkedChild:
    """A child forked by the server: what `run_interpreted` needs of a Popen (wait, poll, kill, returncode)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode, self._done = pid, None, threading.Event()

    def finished(self, returncode: int) -> None:
        self.returncode = returncode
        self._done.set()

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout)
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        if not self._done.is_set():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _fork(server: subprocess.Popen, script: str, argv: tuple[str, ...]):
    """Ask the server to fork a child running script: (the child, its stdout and stderr files)."""
    out, err = (tempfile.NamedTemporaryFile("w+") for _ in range(2))  # noqa: SIM115
    server.stdin.write(json.dumps([script, list(argv), out.name, err.name]) + "\n")
    server.stdin.flush()
    return _ForkedChild(int(server.stdout.readline())), out, err


def start_early(script: str, *argv: str) -> None:
    """Queue the child `run_interpreted(script, *argv)` will collect (once); the queue runs one at a time."""
    global _runner
    with _lock:
        if (script, argv) not in _started and (script, argv) not in _queued:
            _queued.append((script, argv))
        if _runner is None:  # (an empty queue is no sign: the runner pops a child as soon as it starts)
            _runner = threading.Thread(target=_run_queue, name="interpreter children", daemon=True)
            _runner.start()


def _run_queue() -> None:
    global _runner
    server = subprocess.Popen([sys.executable, "-c", FORK_SERVER], cwd=Path(__file__).parent,
                              env={**os.environ, **CHILD_ENV}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        while True:
            with _lock:
                if not _queued:
                    _runner = None
                    return
                key = _queued.pop(0)
                _started[key] = _fork(server, *key)
                child = _started[key][0]
            answer = server.stdout.readline()
            child.finished(int(answer) if answer else -signal.SIGKILL)  # (no answer: the server died)
    finally:
        server.stdin.close()
        server.wait()


def run_interpreted(script: str, *argv: str) -> str:
    """Run `script` (Python source, run in tests/) with TRITON_INTERPRET=1; fails the test with the child's
    stderr unless it exits 0; returns its stdout."""
    with _lock:
        if (script, argv) in _queued:
            _queued.remove((script, argv))
        child = _started.pop((script, argv), None) or _spawn(script, argv)
    process, out, err = child
    try:
        process.wait(timeout=CHILD_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
    with out, err:
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert process.returncode == 0, stderr[-4000:]
    return stdout


def on_cuda_else_interpreted(on_cuda, children: dict, test: str) -> None:
    """A kernel test's body: skipped without triton; on CUDA `on_cuda()` here (Triton compiles for the
    device); elsewhere the test's interpreter child, `children[test]` (its module's INTERPRETED_EARLY)."""
    import importlib.util

    import pytest
    import torch

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        on_cuda()
        return
    run_interpreted(*children[test])


def interpreted_json(script: str, *argv: str):
    """`run_interpreted`, the last line of the child's output read as JSON."""
    return json.loads(run_interpreted(script, *argv).strip().splitlines()[-1])


def stop_unused() -> None:
    with _lock:
        _queued.clear()
        for process, out, err in _started.values():
            process.kill()
            out.close()
            err.close()
        _started.clear()
