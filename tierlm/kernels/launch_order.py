"""Two dependent phases in one launch: programs numbered in the order they start (tickets), and flags that one
phase's programs raise and the other's wait on (the fused MoE's packed decode form runs gate_up and down so).

A program that waits on another program of its own launch must never hold the SM slot that program needs to
start. Programs do not start in program-id order by contract, so a program does not take its work from its
id: it takes a ticket (one atomic add on a counter) and does item `ticket % programs`. Items are numbered
producers first, so by the time any program holds a consumer's number, every producer's number is held by a
program already running or done: a consumer waits only on programs that run. (CUTLASS's serial split-K and
decoupled look-back scans lean on the same order; stream-K's tiles take tickets for the same reason.)

Each counter only grows, so `ticket // programs` numbers the launch (its epoch) without a reset; one counter
per program count (a slot of one kept tensor: `launch_counter`), so every launch on it has the same number
of programs. A flag is raised by writing the launch's tag (epoch and slot, never 0), and a consumer waits
until each of its flags holds its own launch's tag: flags are never reset, and a stale flag (an earlier
launch's, any slot's) never matches. Launches on one stream (and under PDL, whose later kernels start only
once every program of this one has taken its ticket) never interleave their tickets.

A producer raises its flag after its stores (a barrier, then a release atomic); a consumer reads the flags with
acquire atomics before it reads what they guard. Under Triton's interpreter programs run one after another in
id order, so every producer has run before the first consumer looks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.split_reduce import kept_zeros

COUNTER_SLOTS = tl.constexpr(256)  # distinct program counts a device's kernels launch with (a tag: epoch * slots + slot + 1)
_SLOTS: dict[torch.device, dict[int, int]] = {}  # device -> program count -> its slot


def launch_counter(device: torch.device, programs: int) -> tuple[torch.Tensor, int]:
    """(a one-element int64 ticket counter for launches of `programs` programs on `device`, its slot): the same
    counter for every launch of that many programs."""
    device = torch.device(device)
    slots = _SLOTS.setdefault(device, {})
    if programs not in slots:
        if len(slots) == COUNTER_SLOTS.value:
            raise RuntimeError(f"launch_order: more than {COUNTER_SLOTS.value} program counts on {device}")
        slots[programs] = len(slots)
    slot = slots[programs]
    return kept_zeros("launch_order.tickets", device, COUNTER_SLOTS.value, torch.int64)[slot:slot + 1], slot


def launch_flags(owner: str, device: torch.device, count: int) -> torch.Tensor:
    """At least `count` int64 flags for `owner` on `device` (zero when made; a raised flag holds its launch's tag)."""
    return kept_zeros(owner, device, count, torch.int64)


@triton.jit
def take_ticket(counter_ptr, slot):
    """(this program's item, in [0, programs), in the order programs start; this launch's tag), from the
    counter `launch_counter` gave for this many programs and its slot."""
    programs = tl.num_programs(0)
    ticket = tl.atomic_add(counter_ptr, 1, sem="relaxed")
    return (ticket % programs).to(tl.int32), (ticket // programs) * COUNTER_SLOTS + slot + 1


@triton.jit
def raise_flag(flag_ptr, tag):
    """Raise one flag once every thread of the program has issued its stores (they are visible to whoever
    sees the flag)."""
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, tag, sem="release")


@triton.jit
def wait_flags(flag_ptr, count, tag, SPAN: tl.constexpr):
    """Return once flags [0, count) (count <= SPAN) all hold `tag`."""
    offs = tl.arange(0, SPAN)
    inside = offs < count
    pending = count
    while pending > 0:
        seen = tl.atomic_add(flag_ptr + offs, 0, mask=inside, sem="acquire")
        pending = tl.sum((inside & (seen != tag)).to(tl.int32), axis=0)
