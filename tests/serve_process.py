"""`tierlm serve` as a subprocess for the server tests: started on a free port, waited for until /health
answers 200, stopped (and its log closed) on exit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


@dataclass(frozen=True)
class ServerProcess:
    url: str
    port: int
    pid: int
    popen: subprocess.Popen  # for a test that waits for the server to end by itself


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(flags: list[str], log_path: Path, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """`tierlm serve FLAGS` on 127.0.0.1; fails the test with the server's log if it does not come up."""
    port = free_port()
    command = [sys.executable, "-m", "tierlm.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    with open(log_path, "w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    pytest.fail(f"tierlm serve did not come up:\n{log.read()}")
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            yield ServerProcess(url, port, process.pid, process)
        finally:
            process.terminate()
            process.wait(timeout=30)
