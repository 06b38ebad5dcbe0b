"""Session-wide pytest hooks.

After the last test, the process leaves through os._exit with pytest's own exit status. Once, on a
fresh clone, interpreter teardown aborted with "terminate called without an active exception" after all
630 tests had passed, failing `make test`; the re-run passed. The cause was not found: some native pool
torn down at exit while its threads run. Threads still alive at the end of a run, from Python's side
(TIERLM_TEST_THREADS=1 prints them), are tqdm monitors, PLE prefetch workers of engines never closed and
the server's text pool. Native pools are not visible from Python: torch.distributed's gloo groups of the
in-process pipeline rank, xgrammar's compiler pool.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest
from interpreted import start_early, stop_unused


def _children_run_beside() -> bool:
    """Interpreter children exist on CPU only (a GPU runs those tests directly)."""
    import importlib.util

    import torch

    return not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def _has_children(item) -> bool:
    return bool(getattr(getattr(item, "module", None), "INTERPRETED_EARLY", None))


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """One torch thread in the test process: the tiny models' forwards run no faster on two, and many
    times slower when another process holds a core (an interpreter child beside the suite, another job):
    OpenMP threads spin waiting for each other. Measured with one core kept busy: tests/test_llm.py and
    test_model_parity.py took 83 s and 43 s of CPU on two threads, 9.5 s and 9 s of CPU on one.
    Subprocesses (servers, children) keep their own settings."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(session, config, items):
    """The modules with interpreter children run last (in their order, each module's tests in theirs), so
    the children, queued when collection ends, have the whole rest of the suite to finish beside it."""
    if _children_run_beside():
        items.sort(key=_has_children)  # stable


def pytest_collection_finish(session):
    """Queue the interpreter children of the selected tests their modules name in INTERPRETED_EARLY
    ({test function: (script, *argv), or a function of the test's parameters giving them})."""
    if not _children_run_beside():
        return
    for item in session.items:
        early = getattr(getattr(item, "module", None), "INTERPRETED_EARLY", {})
        child = early.get(getattr(item, "originalname", item.name))
        if callable(child):
            child = child(**getattr(getattr(item, "callspec", None), "params", {}))
        if child is not None:
            start_early(*child)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    stop_unused()
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if os.environ.get("TIERLM_TEST_THREADS"):
        print(f"\nthreads alive at the end of the session: {alive}", file=sys.stderr)
    status = getattr(config, "_tierlm_exitstatus", None)
    if status is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def pytest_sessionfinish(session, exitstatus):
    session.config._tierlm_exitstatus = int(exitstatus)
