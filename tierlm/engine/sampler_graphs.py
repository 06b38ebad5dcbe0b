"""The sampling pass replayed from CUDA graphs, one graph per `PassShape` (engine/sampling_pass.py).

Launched eagerly, a pass with a draw is 40-70 small kernels, and on an H200's host their launches cost
1-2 ms a step: more than the forward of a small model, and more than the device spends on them. As a
graph it is a few copies (the logits into a static fp32 buffer, which is also their conversion; the
packed plan's words; the bitmask, the previous step's sampled ids and the rows' prompt bitmasks when the
pass reads them) and one replay. The outputs are the graph's
own tensors: the caller copies what it keeps before the next replay.

A graph is captured the second time its shape comes (`run`: the first pass of a shape runs eagerly, so
a shape that comes once never costs a capture, which synchronizes the device and collects garbage); a
warm-up run on a side stream comes first, so that lazily built kernels, xgrammar's Triton one among
them, are not built inside the capture. The graphs share one memory pool (one replays at a time, on the
engine's stream, and each one's outputs are read before the next). The static inputs are outside the
pool, each shared by the graphs whose input has its shape. `MAX_GRAPHS` graphs are kept, the least
recently used dropped (a shape is rows x which parts run x padded sizes, so a server meets a few dozen).
TIERLM_NO_SAMPLER_GRAPHS=1 runs every pass eagerly (the A/B).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from tierlm.engine.sampling_pass import PassShape

MAX_GRAPHS = 64


def sampler_graphs_enabled() -> bool:
    return os.environ.get("TIERLM_NO_SAMPLER_GRAPHS", "") in ("", "0") and torch.cuda.is_available()


class SamplingGraphs:
    def __init__(self, sampling_pass: Callable, max_graphs: int = MAX_GRAPHS) -> None:
        self.sampling_pass = sampling_pass  # (shape, logits, words, bitmask, previous, prompts) -> tensors
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[PassShape, tuple[torch.cuda.CUDAGraph, tuple, tuple[torch.Tensor, ...]]] = (
            OrderedDict())
        self.pool = None
        self.buffers: dict[tuple, torch.Tensor] = {}  # static inputs, by (what, shape, dtype)
        self.seen: OrderedDict[PassShape, None] = OrderedDict()  # shapes that ran once, eagerly
        self.captures = 0  # graphs captured so far (tests and benches read it)

    def run(self, shape: PassShape, logits: torch.Tensor, words: np.ndarray, bitmask: torch.Tensor | None,
            previous: torch.Tensor | None, prompts: list[torch.Tensor] | None) -> tuple[torch.Tensor, ...] | None:
        """`sampling_pass(shape, ...)`'s outputs for these inputs (logits, the previous step's sampled ids and
        each row's prompt bitmask on the device, the logits in any float dtype; the packed plan's words and
        the bitmask on the host, the bitmask pinned), queued on the current stream; None the first time
        this shape comes (the caller runs that pass eagerly)."""
        inputs = (logits, words, bitmask, previous, prompts)
        entry = self.graphs.get(shape)
        if entry is not None:
            _copy_in(entry[1], *inputs)
            self.graphs.move_to_end(shape)
        elif shape in self.seen:
            entry = self._capture(shape, *inputs)
        else:
            self.seen[shape] = None
            if len(self.seen) > 16 * self.max_graphs:
                self.seen.popitem(last=False)
            return None
        entry[0].replay()
        return entry[2]

    def _buffer(self, what: str, size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (what, size, dtype)
        if key not in self.buffers:
            self.buffers[key] = torch.zeros(size, dtype=dtype, device=device)
        return self.buffers[key]

    def _capture(self, shape: PassShape, logits: torch.Tensor, words: np.ndarray, bitmask: torch.Tensor | None,
                 previous: torch.Tensor | None, prompts: list[torch.Tensor] | None) -> tuple:
        """A graph of the pass at this shape, on static inputs (each shared by the shapes whose input has
        its size), holding these inputs."""
        device = logits.device
        static = (self._buffer("logits", (shape.rows, shape.vocab), torch.float32, device),
                  self._buffer("words", (len(words),), torch.int64, device),
                  None if bitmask is None else self._buffer("bitmask", tuple(bitmask.shape), bitmask.dtype, device),
                  None if previous is None else self._buffer("previous", tuple(previous.shape), previous.dtype, device),
                  None if prompts is None else self._buffer("prompts", (len(prompts), len(prompts[0])), torch.int32,
                                                            device))
        _copy_in(static, logits, words, bitmask, previous, prompts)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up outside the capture
            self.sampling_pass(shape, *static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = self.sampling_pass(shape, *static)
        self.pool = graph.pool()
        self.captures += 1
        entry = (graph, static, outputs)
        self.graphs[shape] = entry
        if len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return entry


def _copy_in(static: tuple, logits: torch.Tensor, words: np.ndarray, bitmask: torch.Tensor | None,
             previous: torch.Tensor | None, prompts: list[torch.Tensor] | None) -> None:
    """The inputs into a graph's static buffers (host ones through pinned memory, without waiting)."""
    static[0].copy_(logits, non_blocking=True)
    static[1].copy_(torch.from_numpy(words).pin_memory(), non_blocking=True)
    if bitmask is not None:
        static[2].copy_(bitmask, non_blocking=True)
    if previous is not None:
        static[3].copy_(previous, non_blocking=True)
    if prompts is not None:
        torch.stack(prompts, out=static[4])
