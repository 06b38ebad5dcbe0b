"""Programmatic dependent launch (PDL, Hopper and later), shared by the decode kernels.

A decode step is a chain of small kernels, each waiting for the one before it. Launched normally, a kernel
starts only after its predecessor has finished and its memory is flushed: every link pays a launch, a ramp
and the first round trip to memory. Launched with PDL (`launch_pdl=True`), a kernel may start as soon as
every program of its predecessor has called `gdc_launch_dependents`; it then loads what no kernel of the
step writes (its weights), calls `gdc_wait` (which returns once the predecessor has finished and its writes
are visible), and only then reads its inputs and writes anything. CUDA graphs keep these edges.
Measured on an H200 (`bench/pdl_probe.py`, session 9, bench/results/pdl_probe_nvidia_h200.txt: 60 dependent GEMVs of 2.1 MB in one graph):
3.24 us a kernel plain, 2.64 with PDL waiting first, 1.53 with the weights loaded before the wait.

The rules every kernel launched here follows (a kernel that breaks them races its neighbours):
  - before `gdc_wait` (the `wait_for_inputs` helper below), it only loads tensors that no kernel of the
    step writes (weights, scales, constant tables), and stores nothing;
  - it calls `wait_for_inputs` in every program, on every path, before its first other memory access;
  - `allow_dependents` (gdc_launch_dependents) may come anywhere: it only lets the next kernel start
    its own weight loads early.
Because each kernel waits for its predecessor to finish, and a kernel finishes only after its own wait,
"finished" is transitive: after the wait, every earlier kernel of the stream has finished too.
One exception to the first rule: a kernel whose predecessor lets it start only once the predecessor's own
wait has returned (`allow_dependents_once_waited`) can start only after the kernel before that one has
finished, so it may load that kernel's output (and any earlier one's) before its own wait; and so may the
kernel after it, which cannot start before it has. The fused MoE's decode forms use this (early weights,
`fused_moe.decode_parts.early_weights`): their routed items read the router's output (which experts) and
start their weight loads before they wait (the packed form's gate_up for x's split copy, both forms' down
for gate_up's activations).

Where a kernel lets the next one start is its trigger (`launch_options`): "start" (its programs allow it
first thing, so the next kernel's weight loads overlap this kernel's whole run; the next one may in turn
allow its own successor before its wait returns, so several kernels can be resident ahead), "wait" (once
this kernel's own wait has returned: at most one kernel ahead), "exit" (only as its programs end: the next
kernel's launch overlaps this one's tail and the memory flush) or "off" (no PDL).

Which trigger pays may depend on the step (H200, "start" against no PDL: 1.07-1.22x at batch 1, 0.88-1.04x
at batch 4, in noisy runs): with one row a kernel's run is short and its weight loads are most of it; with
more rows each kernel runs longer and kernels resident ahead compete with it for bandwidth and slots. So
the trigger is chosen per decode step by its number of rows: a static decode runner (model/static_decode.py)
captures, compiles or runs each of its batch sizes inside `decode_step_rows(rows)`, and `launch_options`
then takes the first entry of PDL_TRIGGERS_BY_ROWS whose bound is >= rows (a CUDA graph keeps the trigger
its capture saw). Outside such a step (prefill, the eager paths) DEFAULT_TRIGGER applies.
TIERLM_PDL_TRIGGER (one of TRIGGERS) overrides the table and the default everywhere; TIERLM_NO_PDL=1 turns
PDL off everywhere. The table is filled from each trigger measured at each batch size, interleaved:
`bench/decode_roofline.py --variants base TIERLM_NO_PDL=1 TIERLM_PDL_TRIGGER=wait TIERLM_PDL_TRIGGER=exit`
(base: this table; while it is all "start", base is the "start" variant).

The kernels take a `PDL: tl.constexpr` argument and their launchers pass `**launch_options(device)`:
PDL is on for CUDA devices of compute capability 9 or more, unless TIERLM_NO_PDL=1; off on the CPU
(Triton's interpreter has no grid dependency control) and on older GPUs (the instructions do nothing
there, but the launch attribute is refused).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

TRIGGERS = {"off": 0, "exit": 1, "wait": 2, "start": 3}  # a trigger -> the PDL constexpr's value
DEFAULT_TRIGGER = "start"  # outside a static decode step (prefill, eager paths)
# (most rows of a decode step, None: any number; its trigger), first match wins. Measured on an H200 at ctx 512,
# 1-16 rows, 5 interleaved rounds (bench/results/decode_roofline_nvidia-h200_pdl_triggers.txt): no same-round
# ratio range of "wait" or "exit" lies above "start"'s (exit is below it at 4 rows: 0.973-0.993x), and PDL off
# is below it at 4 and 8 rows (0.940-0.985x, 0.972-0.981x), so "start" at every width
PDL_TRIGGERS_BY_ROWS: tuple[tuple[int | None, str], ...] = ((1, "start"), (None, "start"))

_step_rows: ContextVar[int | None] = ContextVar("pdl_step_rows", default=None)  # the decode step being launched


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels launched on `device` use programmatic dependent launch."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("TIERLM_NO_PDL"):
        return False
    return _compute_capability(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.cache
def _compute_capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@contextmanager
def decode_step_rows(rows: int) -> Iterator[None]:
    """Kernels launched inside take the trigger of a decode step of `rows` rows (PDL_TRIGGERS_BY_ROWS)."""
    token = _step_rows.set(rows)
    try:
        yield
    finally:
        _step_rows.reset(token)


def trigger_for_rows(rows: int | None) -> str:
    """The trigger of a decode step of `rows` rows (None: outside a decode step), TIERLM_PDL_TRIGGER first."""
    trigger = os.environ.get("TIERLM_PDL_TRIGGER")
    if trigger is None:
        trigger = DEFAULT_TRIGGER if rows is None else next(
            t for bound, t in PDL_TRIGGERS_BY_ROWS if bound is None or rows <= bound)
    if trigger not in TRIGGERS:
        raise ValueError(f"PDL trigger {trigger!r} (TIERLM_PDL_TRIGGER or the table): choose one of "
                         f"{', '.join(TRIGGERS)}")
    return trigger


def launch_options(device: torch.device) -> dict:
    """The PDL constexpr and launch flag for a kernel launched on `device`: `kernel[grid](..., **launch_options(x.device))`.
    PDL is 0 when off, else where a kernel lets the next one start (`trigger_for_rows` of the decode step
    being launched): 1 "exit" (only as each program ends), 2 "wait" (once its own wait has returned), 3 "start"."""
    if not pdl_enabled(device):
        return {"PDL": 0, "launch_pdl": False}
    value = TRIGGERS[trigger_for_rows(_step_rows.get())]
    return {"PDL": value, "launch_pdl": value > 0}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Under PDL, wait until the previous kernel has finished and its writes are visible (see the rules above)."""
    if PDL:
        gdc_wait()
    if PDL == 2:
        gdc_launch_dependents()


@triton.jit
def allow_dependents_once_waited(PDL: tl.constexpr):
    """Called after `wait_for_inputs`, in place of `allow_dependents`: under the "start" trigger, lets the next
    kernel start only now (the exception to the rules above); the other triggers are as they were."""
    if PDL == 3:
        gdc_launch_dependents()


@triton.jit
def allow_dependents(PDL: tl.constexpr):
    """Under PDL, let the next kernel start (its programs begin with their weight loads, then wait)."""
    if PDL == 3:
        gdc_launch_dependents()
