"""`--trace FILE`: where each engine step's time goes, as a Chrome-trace / Perfetto JSON (open it at
ui.perfetto.dev or chrome://tracing).

Host phases (schedule, prepare the batch, launch the forward, wait for and copy the logits, sample,
apply the results) are complete events ("ph": "X") on the "host" track, timed with the monotonic clock in
ns and written in us, each with its step number. On CUDA the forward's GPU time, from two CUDA events
around it (the graph replay or the eager forward), goes on the "gpu" track, starting where the host
launched it (the events give a duration, not the device clock), and so does "between forwards": the device
time from the end of one forward to the start of the next (sampling, input copies, and any time the
device waited for the host: what overlap scheduling hides). Events are resolved without a sync as
they complete; the file is rewritten every FLUSH_STEPS steps and at exit, so a crash loses little.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

FLUSH_STEPS = 256


class StepTrace:
    def __init__(self, path: str | os.PathLike, device: torch.device) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.cuda = device.type == "cuda"
        self.origin_ns = time.monotonic_ns()
        self.step = 0
        self.events: list[dict] = []
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event, float, int, str]] = []
        self._last_ended: torch.cuda.Event | None = None  # the end of the last forward
        atexit.register(self.flush)

    def _us(self, ns: int) -> float:
        return (ns - self.origin_ns) / 1000

    @contextmanager
    def phase(self, name: str):
        """A host phase of the current step."""
        start = time.monotonic_ns()
        try:
            yield
        finally:
            end = time.monotonic_ns()
            self.events.append({"name": name, "ph": "X", "pid": 0, "tid": "host", "ts": self._us(start),
                                "dur": (end - start) / 1000, "args": {"step": self.step}})

    @contextmanager
    def gpu(self, name: str):
        """The device time of the work launched inside (CUDA only)."""
        if not self.cuda:
            yield
            return
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        launched = self._us(time.monotonic_ns())
        began.record()
        if self._last_ended is not None:
            self._pending.append((self._last_ended, began, launched, self.step, f"between {name}s"))
        try:
            yield
        finally:
            ended.record()
            self._last_ended = ended
            self._pending.append((began, ended, launched, self.step, name))

    def end_step(self, num_tokens: int) -> None:
        self.events.append({"name": "step", "ph": "i", "s": "t", "pid": 0, "tid": "host",
                            "ts": self._us(time.monotonic_ns()), "args": {"step": self.step, "tokens": num_tokens}})
        self._resolve(wait=False)
        self.step += 1
        if self.step % FLUSH_STEPS == 0:
            self.flush()

    def _resolve(self, wait: bool) -> None:
        while self._pending:
            began, ended, launched, step, name = self._pending[0]
            if not wait and not ended.query():
                return
            ended.synchronize()
            self.events.append({"name": name, "ph": "X", "pid": 0, "tid": "gpu", "ts": launched,
                                "dur": began.elapsed_time(ended) * 1000, "args": {"step": step}})
            self._pending.pop(0)

    def flush(self) -> None:
        """Write every event so far (the whole file, replaced atomically)."""
        self._resolve(wait=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms",
                                       "otherData": {"steps": self.step, "clock": "monotonic"}}))
        partial.replace(self.path)


class NoTrace:
    """What the engine holds without --trace: every hook does nothing."""

    def phase(self, name: str):
        return nullcontext()

    gpu = phase

    def end_step(self, num_tokens: int) -> None:
        pass

    def flush(self) -> None:
        pass
