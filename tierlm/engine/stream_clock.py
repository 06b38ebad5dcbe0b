"""StreamClock: how long a region of a process's work takes on its device, summed over many regions.

On CPU the region's host time. On CUDA the stream's time between two events recorded around the region
(so the time the device spent on what was queued there, or waiting in it, not the host's launch time);
finished events are folded in as they complete, without a sync, and `total` syncs for the rest. The
pipeline's ranks time their layers and their wait for the previous stage's hidden state with it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class StreamClock:
    """The summed time of the regions run under `timed()`: host time on CPU, stream time on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.events: list[tuple] = []
        self.seconds = 0.0

    @contextmanager
    def timed(self):
        if not self.cuda:
            began = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - began
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.events.append((start, end))
        while self.events and self.events[0][1].query():  # fold the finished ones: the list stays short
            done_start, done_end = self.events.pop(0)
            self.seconds += done_start.elapsed_time(done_end) / 1e3

    def total(self) -> float:
        if self.events:
            torch.cuda.synchronize()
            self.seconds += sum(start.elapsed_time(end) for start, end in self.events) / 1e3
            self.events = []
        return self.seconds
