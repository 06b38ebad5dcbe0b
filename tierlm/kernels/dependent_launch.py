"""Programmatic dependent launch (PDL, Hopper and later), shared by the decode kernels.

A decode step is a chain of small kernels, each waiting for the one before it. Launched normally, a kernel
starts only after its predecessor has finished and its memory is flushed: every link pays a launch, a ramp
and the first round trip to memory. Launched with PDL (`launch_pdl=True`), a kernel may start as soon as
every program of its predecessor has called `gdc_launch_dependents`; it then loads what no kernel of the
step writes (its weights), calls `gdc_wait` (which returns once the predecessor has finished and its writes
are visible), and only then reads its inputs and writes anything. CUDA graphs keep these edges.
Measured on an H200 (`.scratch/pdl_probe.py`, session 9: 60 dependent GEMVs of 2.1 MB in one graph):
3.24 us a kernel plain, 2.64 with PDL waiting first, 1.53 with the weights loaded before the wait.

The rules every kernel launched here follows (a kernel that breaks them races its neighbours):
  - before `gdc_wait` (the `wait_for_inputs` helper below), it only loads tensors that no kernel of the
    step writes (weights, scales, constant tables), and stores nothing;
  - it calls `wait_for_inputs` in every program, on every path, before its first other memory access;
  - `allow_dependents` (gdc_launch_dependents) may come anywhere: it only lets the next kernel start
    its own weight loads early.
Because each kernel waits for its predecessor to finish, and a kernel finishes only after its own wait,
"finished" is transitive: after the wait, every earlier kernel of the stream has finished too.

Where a kernel lets the next one start is TIERLM_PDL_TRIGGER (`launch_options`): "start" (its programs
allow it first thing, so the next kernel's weight loads overlap this kernel's whole run; the next one may
in turn allow its own successor before its wait returns, so several kernels can be resident ahead),
"wait" (once this kernel's own wait has returned: at most one kernel ahead) or "exit" (only as its
programs end: the next kernel's launch overlaps this one's tail and the memory flush). Measured A/B:
`bench/decode_roofline.py --ab TIERLM_NO_PDL` under each.

The kernels take a `PDL: tl.constexpr` argument and their launchers pass `**launch_options(device)`:
PDL is on for CUDA devices of compute capability 9 or more, unless TIERLM_NO_PDL=1; off on the CPU
(Triton's interpreter has no grid dependency control) and on older GPUs (the instructions do nothing
there, but the launch attribute is refused).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

TRIGGERS = {"exit": 1, "wait": 2, "start": 3}  # TIERLM_PDL_TRIGGER -> the PDL constexpr's value


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels launched on `device` use programmatic dependent launch."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("TIERLM_NO_PDL"):
        return False
    return _compute_capability(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.cache
def _compute_capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def launch_options(device: torch.device) -> dict:
    """The PDL constexpr and launch flag for a kernel launched on `device`: `kernel[grid](..., **launch_options(x.device))`.
    PDL is 0 when off, else where a kernel lets the next one start (TIERLM_PDL_TRIGGER, default "start"):
    1 "exit" (only as each program ends), 2 "wait" (once its own wait has returned), 3 "start"."""
    if not pdl_enabled(device):
        return {"PDL": 0, "launch_pdl": False}
    trigger = os.environ.get("TIERLM_PDL_TRIGGER", "start")
    if trigger not in TRIGGERS:
        raise ValueError(f"TIERLM_PDL_TRIGGER={trigger!r}: choose one of {', '.join(TRIGGERS)}")
    return {"PDL": TRIGGERS[trigger], "launch_pdl": True}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Under PDL, wait until the previous kernel has finished and its writes are visible (see the rules above)."""
    if PDL:
        gdc_wait()
    if PDL == 2:
        gdc_launch_dependents()


@triton.jit
def allow_dependents(PDL: tl.constexpr):
    """Under PDL, let the next kernel start (its programs begin with their weight loads, then wait)."""
    if PDL == 3:
        gdc_launch_dependents()
