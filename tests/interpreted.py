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
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CHILD_TIMEOUT_S = 1200
# one thread each: a child runs beside the suite, and spinning OpenMP pools of several processes on two
# cores slow everything down many times over
CHILD_ENV = {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

_started: dict[tuple[str, tuple[str, ...]], tuple[subprocess.Popen, object, object]] = {}
_queued: list[tuple[str, tuple[str, ...]]] = []
_runner: threading.Thread | None = None  # the one thread that runs the queue, while it has work
_lock = threading.Lock()


def _spawn(script: str, argv: tuple[str, ...]):
    # files, not pipes: a chatty child never blocks; the collector closes them
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-c", script, *argv], cwd=Path(__file__).parent, env={**os.environ, **CHILD_ENV},
        stdout=out, stderr=err, text=True,
    )
    return process, out, err


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
    running = None
    while True:
        with _lock:
            if running is None or running.poll() is not None:
                if not _queued:
                    _runner = None
                    return
                key = _queued.pop(0)
                _started[key] = _spawn(*key)
                running = _started[key][0]
        time.sleep(0.2)


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
