"""Host pools (memory/host_pool): exact-size mappings, the free-RAM check, ranks serialised by the lock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tierlm.memory.host_pool import HostMemoryError, HostPool, allocate_pools
from tierlm.memory.madvise import PAGE_SIZE

ODD_BYTES = int(4.24 * 2**20) + 3  # 4.24 MiB and a few bytes: neither page-aligned nor a power of two


def smaps_entries(pid: int) -> list[dict]:
    """The mappings of a process from /proc/PID/smaps: start address, path, Size and Rss in bytes."""
    entries = []
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                entries.append({"start": int(head[0].split("-")[0], 16), "path": " ".join(head[5:])})
            elif head[0] in ("Size:", "Rss:"):
                entries[-1][head[0][:-1]] = int(head[1]) * 1024
    return entries


def page_round(nbytes: int) -> int:
    return -(-nbytes // PAGE_SIZE) * PAGE_SIZE


def test_pool_is_the_requested_size_rounded_to_a_page_not_to_a_power_of_two():
    pool = HostPool((ODD_BYTES,), torch.uint8)
    try:
        assert pool.nbytes == ODD_BYTES and not pool.pinned
        assert pool.mapped_bytes == page_round(ODD_BYTES) < 2 ** (ODD_BYTES - 1).bit_length()
        assert pool.resident_bytes() == pool.mapped_bytes  # committed at construction
        # the kernel's own account of the mapping agrees
        (entry,) = [e for e in smaps_entries(os.getpid()) if e["start"] == pool.data_ptr()]
        assert entry["Size"] == entry["Rss"] == pool.mapped_bytes
    finally:
        pool.close()


def test_tensor_view_reads_back_what_was_written():
    shape = (37, 16, 2, 24)  # [blocks, block_size, nkv, hd]
    pool = HostPool(shape, torch.bfloat16)
    try:
        assert pool.tensor.shape == shape and pool.tensor.dtype == torch.bfloat16
        assert pool.nbytes == 37 * 16 * 2 * 24 * 2 and pool.data_ptr() % PAGE_SIZE == 0
        assert not pool.tensor.any()  # fresh anonymous memory is zero
        data = torch.randn(shape).to(torch.bfloat16)
        pool.tensor.copy_(data)
        rows = torch.tensor([5, 0, 36 * 16 + 15])
        assert torch.equal(pool.tensor.view(-1, 2, 24)[rows], data.view(-1, 2, 24)[rows])
    finally:
        pool.close()
    assert pool.tensor is None


def test_allocate_pools_commits_each_pool(tmp_path):
    specs = {"qsa.3.key": ((5, 16, 2, 24), torch.float16), "qsa.3.value": ((ODD_BYTES,), torch.uint8)}
    pools = allocate_pools(specs, pin=False, lock_path=str(tmp_path / "lock"))
    try:
        assert pools["qsa.3.key"].tensor.shape == (5, 16, 2, 24)
        assert all(p.resident_bytes() == page_round(p.nbytes) for p in pools.values())
    finally:
        for pool in pools.values():
            pool.close()


def test_refuses_pools_that_do_not_fit_and_says_why(tmp_path):
    lock = str(tmp_path / "lock")
    specs = {"qsa.3.key": ((1000, 256), torch.bfloat16), "qsa.3.value": ((1000, 256), torch.bfloat16)}
    with pytest.raises(HostMemoryError) as info:
        allocate_pools(specs, pin=False, margin_bytes=100_000, lock_path=lock,
                       available_bytes=lambda: 1_000_000)
    message = str(info.value)
    for expected in ("qsa.3.key: 512,000 B", "qsa.3.value: 512,000 B", "1,024,000 B in all",
                     "margin of 100,000 B", "1,000,000 B of RAM is available", "short by 124,000 B"):
        assert expected in message
    # the lock was released: the same lock file lets the next caller through at once
    pools = allocate_pools(specs, pin=False, margin_bytes=0, lock_path=lock,
                           available_bytes=lambda: 2_000_000)
    assert set(pools) == set(specs)


# ---- ranks racing for host memory ----------------------------------------------------------------------

# A racer stands for one rank of a server starting on a shared host. The host's MemAvailable is faked
# as a fixed total minus what the racers' pools really hold: the Rss of their pool mappings, read from
# each racer's /proc/PID/smaps (the pool's size is odd, so its mapping is recognised by Size). The check
# sleeps, so without the lock both racers would check before either had committed anything.
RACER = r"""
import json, os, sys, time
from pathlib import Path
import torch
from tierlm.memory.host_pool import HostMemoryError, allocate_pools
from tierlm.memory.madvise import PAGE_SIZE
sys.path.insert(0, sys.argv[6])
from test_host_pool import smaps_entries

lock, folder, name = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
nbytes, fake_total = int(sys.argv[4]), int(sys.argv[5])
mapped = -(-nbytes // PAGE_SIZE) * PAGE_SIZE
(folder / f"{name}.pid").write_text(str(os.getpid()))
while not (folder / "go").exists():
    time.sleep(0.001)

def pools_resident():
    total = 0
    for pid_file in folder.glob("*.pid"):
        total += sum(e.get("Rss", 0) for e in smaps_entries(int(pid_file.read_text()))
                     if e["path"].startswith("/dev/zero") and e.get("Size") == mapped)
    return total

def fake_available():
    enter = time.monotonic()
    available = fake_total - pools_resident()
    time.sleep(0.4)
    (folder / f"{name}.check").write_text(json.dumps([enter, time.monotonic(), available]))
    return available

try:
    pools = allocate_pools({name: ((nbytes,), torch.uint8)}, pin=False, margin_bytes=0, lock_path=lock,
                           available_bytes=fake_available)
    result = {"resident": pools[name].resident_bytes()}
except HostMemoryError as exc:
    result = {"refused": str(exc)}
(folder / f"{name}.result").write_text(json.dumps(result))
while len(list(folder.glob("*.result"))) < 2:  # hold the pool until the other racer is done
    time.sleep(0.01)
"""


def race(tmp_path, fake_total: int) -> tuple[list, list]:
    """Two racers for ODD_BYTES each, started together; their (check interval, result), by check order."""
    script = tmp_path / "racer.py"
    script.write_text(RACER)
    tests_dir = str(Path(__file__).parent)
    procs = [
        subprocess.Popen([sys.executable, str(script), str(tmp_path / "lock"), str(tmp_path), name,
                          str(ODD_BYTES), str(fake_total), tests_dir])
        for name in ("a", "b")
    ]
    try:
        deadline = time.monotonic() + 40
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        (tmp_path / "go").touch()
        assert [proc.wait(timeout=600) for proc in procs] == [0, 0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    names = sorted("ab", key=lambda n: json.loads((tmp_path / f"{n}.check").read_text())[0])
    checks = [json.loads((tmp_path / f"{n}.check").read_text()) for n in names]
    results = [json.loads((tmp_path / f"{n}.result").read_text()) for n in names]
    return checks, results


def test_racing_ranks_check_and_allocate_one_at_a_time(tmp_path):
    fake_total = 10 * ODD_BYTES  # room for both
    (first, second), results = race(tmp_path, fake_total)
    assert first[1] <= second[0], "the two checks overlapped in time"
    # the second check ran after the first pool was committed, and saw it
    assert first[2] == fake_total and second[2] == fake_total - page_round(ODD_BYTES)
    assert results == [{"resident": page_round(ODD_BYTES)}] * 2


def test_second_rank_is_refused_when_the_first_took_the_memory(tmp_path):
    fake_total = ODD_BYTES * 3 // 2  # room for one pool only
    (first, second), (won, lost) = race(tmp_path, fake_total)
    assert first[1] <= second[0]
    assert won == {"resident": page_round(ODD_BYTES)}
    assert f"only {fake_total - page_round(ODD_BYTES):,} B of RAM is available" in lost["refused"]
