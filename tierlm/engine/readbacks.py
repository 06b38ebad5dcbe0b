"""Small per-step results copied from the device to the host without a new pinned buffer or event each step."""

from __future__ import annotations

import torch


class Readbacks:
    """The host side of launched steps' readbacks: two [max_batch, width] int64 buffers (pinned on CUDA) used in
    turn, each with the event recorded after its copy, made once. The caller keeps at most two launched steps
    unread at a time (overlap scheduling reads the step in flight before it launches the second one after it;
    a serial step is read at once), so a buffer's last step has been read by the time its turn comes back.
    What uses them: greedy speculative steps (engine/speculative.py, width 2 + K: accepted count, token
    after them, next drafts) and plain greedy decode steps (engine/model_runner.py, width 2: token, status)."""

    def __init__(self, max_batch: int, width: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.max_batch = max_batch
        self.buffers = [torch.zeros(max_batch, width, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self.copied = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.turn = 0

    def copy(self, readback: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Queue the copy of a step's readback [B, width] into the next buffer: its rows there, and the event
        that says the copy has run (None on CPU: it has)."""
        self.turn ^= 1
        host, event = self.buffers[self.turn][: readback.shape[0]], self.copied[self.turn]
        host.copy_(readback, non_blocking=event is not None)
        if event is not None:
            event.record()
        return host, event
