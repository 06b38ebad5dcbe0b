"""kernels/launch_order: tickets in start order, per-launch tags, flags raised by one phase and awaited by the
other in the same launch; the kept counters' bookkeeping. The kernel runs on the GPU when there is one, else in
a child under Triton's interpreter (tests/interpreted.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from interpreted import interpreted_json

from tierlm.kernels import launch_order
from tierlm.kernels.split_reduce import kept_zeros

PRODUCERS = 6  # producers (items 0-5) each write one value and raise its flag; consumers sum all six


def run_launches(device: str) -> dict:
    """Three launches: 6 producers + 2 consumers twice, then 6 + 3 (another program count: another slot).
    Returns each launch's consumer sums, the flags' tags after each, and the counters."""
    import triton
    import triton.language as tl

    @triton.jit
    def producers_then_consumers(counter_ptr, slot, flags_ptr, values_ptr, sums_ptr, step,
                                 PRODUCERS: tl.constexpr, SPAN: tl.constexpr):
        index, tag = launch_order.take_ticket(counter_ptr, slot)
        if index < PRODUCERS:
            tl.store(values_ptr + index, (index + 1) * step)
            launch_order.raise_flag(flags_ptr + index, tag)
        else:
            launch_order.wait_flags(flags_ptr, PRODUCERS, tag, SPAN)
            offs = tl.arange(0, SPAN)
            seen = tl.load(values_ptr + offs, mask=offs < PRODUCERS, other=0)
            tl.store(sums_ptr + index - PRODUCERS, tl.sum(seen, axis=0))

    flags = torch.zeros(PRODUCERS, dtype=torch.int64, device=device)
    values = torch.zeros(PRODUCERS, dtype=torch.int32, device=device)
    launches = []
    for step, consumers in ((1, 2), (10, 2), (100, 3)):
        counter, slot = launch_order.launch_counter(torch.device(device), PRODUCERS + consumers)
        sums = torch.full((consumers,), -1, dtype=torch.int32, device=device)
        producers_then_consumers[(PRODUCERS + consumers,)](counter, slot, flags, values, sums, step,
                                                           PRODUCERS=PRODUCERS, SPAN=8)
        launches.append({"slot": slot, "sums": sums.tolist(), "tags": flags.tolist(), "counter": counter.item()})
    return {"launches": launches}


@pytest.fixture(scope="module")
def launches() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        return run_launches("cuda")
    return interpreted_json(*INTERPRETED_EARLY["test_consumers_see_every_producer_of_their_own_launch"])


INTERPRETED_EARLY = {
    "test_consumers_see_every_producer_of_their_own_launch": (
        "import json, test_launch_order as t\nprint(json.dumps(t.run_launches('cpu')))",),
}


def test_consumers_see_every_producer_of_their_own_launch(launches):
    sums = [launch["sums"] for launch in launches["launches"]]
    assert sums == [[21, 21], [210, 210], [2100, 2100, 2100]]  # (1 + ... + 6) x step: this launch's values


def test_tags_number_each_launch_and_its_program_count(launches):
    """8 programs twice on one slot, then 9 on another: each launch's flags hold epoch * COUNTER_SLOTS + slot + 1
    (epoch: the launches of that many programs before it), never a tag another launch raised, so an earlier
    launch's flag is never taken for this one's. (On a GPU earlier tests may have launched as many programs.)"""
    first, second, third = launches["launches"]
    slots = launch_order.COUNTER_SLOTS.value
    assert first["slot"] == second["slot"] != third["slot"]
    assert second["counter"] - first["counter"] == 8 and first["counter"] % 8 == 0 and third["counter"] % 9 == 0
    epoch = first["counter"] // 8 - 1
    assert first["tags"] == [epoch * slots + first["slot"] + 1] * PRODUCERS
    assert second["tags"] == [(epoch + 1) * slots + second["slot"] + 1] * PRODUCERS
    assert third["tags"] == [(third["counter"] // 9 - 1) * slots + third["slot"] + 1] * PRODUCERS


def test_one_counter_per_program_count(monkeypatch):
    monkeypatch.setattr(launch_order, "_SLOTS", {})
    cpu = torch.device("cpu")
    a, slot_a = launch_order.launch_counter(cpu, 40)
    b, slot_b = launch_order.launch_counter(cpu, 41)
    again, slot_again = launch_order.launch_counter(cpu, 40)
    assert slot_a == slot_again != slot_b
    assert again.data_ptr() == a.data_ptr() != b.data_ptr() and a.dtype == torch.int64 and a.numel() == 1
    monkeypatch.setattr(launch_order, "_SLOTS", {cpu: dict.fromkeys(range(launch_order.COUNTER_SLOTS.value), 0)})
    with pytest.raises(RuntimeError, match="more than 256 program counts"):
        launch_order.launch_counter(cpu, 10_000)


def test_kept_zeros_keep_their_dtype():
    flags = launch_order.launch_flags("test_launch_order.flags", torch.device("cpu"), 10)
    assert flags.dtype == torch.int64 and not flags.any()
    assert launch_order.launch_flags("test_launch_order.flags", torch.device("cpu"), 5).data_ptr() == flags.data_ptr()
    with pytest.raises(ValueError, match="kept as torch.int64, asked for as torch.int32"):
        kept_zeros("test_launch_order.flags", torch.device("cpu"), 5, torch.int32)
