"""The vision tower's weights in host memory, streamed to the device unit by unit while it encodes
(`--mm-encoder-offload`, as the seed deployment ran its ViT).

A unit is one module the tower's forward runs whole, each once and in a fixed order (patch embed, position
table, every block, merger). `StreamedWeights` packs each unit's parameters into one host buffer (pinned on
CUDA) at 512-byte aligned offsets, and the module's parameters become views of that buffer: between
encodes no byte of the tower is on the device.

An encode (`session`) allocates two device slots of the largest unit. While unit i computes from one slot,
unit i+1 is copied into the other on a side stream (one host-to-device copy per unit, recorded as an
event); the compute stream waits on that event before running unit i+1, and the copy into a slot waits on
the event recorded after the compute that last read it. The slots return to the allocator when the encode
ends. A unit runs through `torch.func.functional_call` on its slot's views: the same module code on the
same values, aligned as the allocator aligns resident tensors, so the features are bit-identical to the
resident tower's. On CPU the same code runs, the copies plain and in order.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

ALIGN_BYTES = 512  # each tensor's offset in a unit's buffer (what the CUDA allocator gives resident tensors)


@dataclass(frozen=True)
class HostUnit:
    """One unit: its module, the host buffer holding all its parameters, and where each one sits."""

    module: nn.Module
    host: torch.Tensor  # flat, the tower's dtype; pinned on CUDA
    layout: tuple[tuple[str, torch.Size, int], ...]  # (parameter name in the module, shape, element offset)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The unit's parameters as views of `flat` (a slot, or the host buffer) laid out as `host`."""
        return {name: flat[offset : offset + shape.numel()].view(shape) for name, shape, offset in self.layout}


class StreamedWeights:
    """The tower's units in host memory; `session()` runs them with their weights streamed to `device`."""

    def __init__(self, units: list[nn.Module], device: torch.device | str) -> None:
        self.device = torch.device(device)
        dtypes = {p.dtype for unit in units for p in unit.parameters()}
        if len(dtypes) != 1:
            raise ValueError(f"streamed units must share one dtype, got {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        align = ALIGN_BYTES // self.dtype.itemsize
        pin = self.device.type == "cuda"
        self.units: list[HostUnit] = []
        for module in units:
            if next(module.buffers(), None) is not None:
                raise ValueError(f"a streamed unit holds parameters only, {type(module).__name__} has buffers")
            layout, size = [], 0
            for name, param in module.named_parameters():
                layout.append((name, param.shape, size))
                size += -(-param.numel() // align) * align
            unit = HostUnit(module, torch.zeros(size, dtype=self.dtype, pin_memory=pin), tuple(layout))
            for name, view in unit.views(unit.host).items():
                owner, _, leaf = name.rpartition(".")
                holder = module.get_submodule(owner)
                view.copy_(getattr(holder, leaf).detach())
                holder.register_parameter(leaf, nn.Parameter(view, requires_grad=False))
            self.units.append(unit)
        self.slot_numel = max(unit.host.numel() for unit in self.units)

    @property
    def host_bytes(self) -> int:
        return sum(unit.host.numel() for unit in self.units) * self.dtype.itemsize

    @contextmanager
    def session(self):
        """Yields run(module, *args): the next unit (it must be `module`) called on `args` with its weights
        in a device slot, the unit after it already on its way into the other slot."""
        session = _Session(self)
        try:
            yield session.run
        finally:
            session.close()


class _Session:
    """One encode's two slots and copy events."""

    def __init__(self, weights: StreamedWeights) -> None:
        self.units = weights.units
        self.slots = torch.empty(2, weights.slot_numel, dtype=weights.dtype, device=weights.device)
        self.cuda = weights.device.type == "cuda"
        self.compute = torch.cuda.current_stream(weights.device) if self.cuda else None
        self.side = torch.cuda.Stream(weights.device) if self.cuda else None
        self.copied: list[torch.cuda.Event | None] = [None] * len(self.units)
        self.read: list[torch.cuda.Event | None] = [None] * len(self.units)
        self.next = 0
        if self.cuda:  # the slots' memory may still be read by earlier work on the compute stream
            self.side.wait_stream(self.compute)
        self._copy(0)

    def _copy(self, index: int) -> None:
        unit = self.units[index]
        slot = self.slots[index % 2, : unit.host.numel()]
        if not self.cuda:
            slot.copy_(unit.host)
            return
        with torch.cuda.stream(self.side):
            if index >= 2:  # the slot's previous unit must be done computing
                self.side.wait_event(self.read[index - 2])
            slot.copy_(unit.host, non_blocking=True)
            self.copied[index] = torch.cuda.Event()
            self.copied[index].record(self.side)

    def run(self, module: nn.Module, *args):
        index = self.next
        if index >= len(self.units) or self.units[index].module is not module:
            raise RuntimeError(f"streamed tower: unit {index} called out of order ({type(module).__name__})")
        self.next += 1
        if index + 1 < len(self.units):
            self._copy(index + 1)
        unit = self.units[index]
        if self.cuda:
            self.compute.wait_event(self.copied[index])
        out = functional_call(module, unit.views(self.slots[index % 2]), args)
        if self.cuda:
            self.read[index] = torch.cuda.Event()
            self.read[index].record(self.compute)
        return out

    def close(self) -> None:
        if self.cuda and self.next < len(self.units):  # an encode that failed midway: let its copies land
            self.compute.wait_stream(self.side)
        del self.slots
