"""Kernel tests without a GPU: run test code in a child Python under Triton's interpreter.

TRITON_INTERPRET=1 must be set before triton is first imported, so the test process (which may have
imported it already) cannot switch; each kernel test hands its comparison to a child instead. The timeout
is generous: the interpreter is slow, and slower still on a loaded machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CHILD_TIMEOUT_S = 1200


def run_interpreted(script: str, *argv: str) -> str:
    """Run `script` (Python source, run in tests/) with TRITON_INTERPRET=1; fails the test with the child's
    stderr unless it exits 0; returns its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", script, *argv], cwd=Path(__file__).parent, env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def interpreted_json(script: str, *argv: str):
    """`run_interpreted`, the last line of the child's output read as JSON."""
    return json.loads(run_interpreted(script, *argv).strip().splitlines()[-1])
