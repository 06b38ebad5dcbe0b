"""Host pools: tensors in (pinned) host RAM of exactly the requested size, allocated one rank at a time.

What this module owns: a pool's memory (one anonymous mapping), its torch view, its pinning, and the
start-up check that all pools fit in RAM. Not what the pools hold (QSA K/V rows: `model/model_cache`)
nor who reads them (decode kernels over UVA).

Why not `torch.empty(..., pin_memory=True)`: PyTorch's caching host allocator rounds every pinned block
up to a power of two, so a 4.24 GiB pool takes 8 GiB. A `HostPool` is one `mmap.mmap(-1, nbytes)`, which
the kernel rounds to a page and no further; its pages are committed at construction, and on CUDA the
range is page-locked in place with `cudaHostRegister`.

Reading a pool from the GPU: with unified virtual addressing (every 64-bit Linux CUDA platform),
`cudaHostRegister(ptr, n, cudaHostRegisterDefault)` also maps the range into the devices' address space,
and where cudaDevAttrCanUseHostPointerForRegisteredMem is set (x86-64 Linux, every GPU CUDA 12 supports)
at the same address: `HostPool.data_ptr()` is then a pointer a kernel may dereference, each load
crossing PCIe. Triton's launcher passes a tensor argument's `data_ptr()` through cuPointerGetAttribute
(CU_POINTER_ATTRIBUTE_DEVICE_POINTER), which resolves registered host memory to its device address, so a
Triton kernel can be handed the pool's CPU tensor as is and read only the rows it needs.

The mapping is MAP_SHARED (what `mmap.mmap(-1, n)` gives): shmem pages are never copy-on-write after a
fork and the mapping is never merged with a neighbour, so what is resident is exactly what was asked.

Several ranks start at once on one host: `allocate_pools` reads MemAvailable and commits (and pins) its
pools under an exclusive `flock` on one lock file, so the next rank checks only once the previous rank's
pages are resident and MemAvailable counts them.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import mmap
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence

import torch

from tierlm.memory.madvise import PAGE_SIZE, resident_pages

logger = logging.getLogger("tierlm")

DEFAULT_MARGIN_BYTES = 2 << 30  # left free for the OS, page cache and the processes' own heaps
MADV_POPULATE_WRITE = 23  # not in Python's mmap module before 3.14


class HostMemoryError(ValueError):
    """The host pools do not fit in the RAM available (after the safety margin)."""


class _Mapping(mmap.mmap):
    """An anonymous mapping that drops its CUDA registration before it is unmapped.

    Torch views made with `torch.frombuffer` keep the mapping alive, so the memory outlives every view
    and is unmapped only when the last one is gone; `__del__` runs just before that.
    """

    registered_at: int | None = None

    def unregister(self) -> None:
        if self.registered_at is not None:
            address, self.registered_at = self.registered_at, None
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(address))

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the CUDA runtime may be gone already
            self.unregister()


def _commit(mapping: mmap.mmap) -> None:
    """Make every page of a fresh mapping resident: MADV_POPULATE_WRITE (Linux >= 5.14) faults them all
    in one call; before that, one written byte per page (a read would only map the shared zero page)."""
    try:
        mapping.madvise(MADV_POPULATE_WRITE)
    except OSError:
        torch.frombuffer(mapping, dtype=torch.uint8)[::PAGE_SIZE].zero_()


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("MemAvailable not found in /proc/meminfo")


def pool_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class HostPool:
    """One tensor of `shape` and `dtype` in its own anonymous mapping, committed (and pinned if `pin`).

    `tensor` is the view to index; `data_ptr()` its address (device-usable over UVA when pinned).
    `close()` unpins and drops the pool's references: the memory is unmapped once no view of it remains.
    """

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, *, pin: bool = False) -> None:
        self.shape, self.dtype = tuple(shape), dtype
        self.nbytes = pool_bytes(self.shape, dtype)
        if self.nbytes <= 0:
            raise ValueError(f"a host pool needs at least one byte, got shape {self.shape}")
        self._mapping = _Mapping(-1, self.nbytes)
        _commit(self._mapping)
        self.tensor = torch.frombuffer(self._mapping, dtype=dtype).view(self.shape)
        self.pinned = False
        if pin:
            cudart = torch.cuda.cudart()  # initialises CUDA
            torch.cuda.check_error(cudart.cudaHostRegister(self.data_ptr(), self.nbytes, 0))
            self._mapping.registered_at = self.data_ptr()
            self.pinned = True

    @property
    def mapped_bytes(self) -> int:
        """What the mapping occupies: the requested size rounded up to a page."""
        return -(-self.nbytes // PAGE_SIZE) * PAGE_SIZE

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def resident_bytes(self) -> int:
        """Bytes of the mapping in RAM right now (mincore, whole pages)."""
        return int(resident_pages(self.data_ptr(), self.nbytes).sum()) * PAGE_SIZE

    def close(self) -> None:
        """Unpin (the device must be done reading) and let go; no view may be used by a kernel after."""
        if self._mapping is not None:
            self._mapping.unregister()
            self.pinned = False
            self._mapping, self.tensor = None, None


def default_lock_path() -> str:
    """One lock file per user and host: $XDG_RUNTIME_DIR if set, else the temporary directory."""
    folder = os.environ.get("XDG_RUNTIME_DIR")
    if not folder or not os.path.isdir(folder):
        folder = tempfile.gettempdir()
    return os.path.join(folder, f"tierlm-host-pools-{os.getuid()}.lock")


def allocate_pools(
    specs: Mapping[str, tuple[Sequence[int], torch.dtype]],
    *,
    pin: bool | None = None,
    margin_bytes: int = DEFAULT_MARGIN_BYTES,
    lock_path: str | None = None,
    available_bytes: Callable[[], int] = available_ram_bytes,
) -> dict[str, HostPool]:
    """Allocate, commit and pin one `HostPool` per spec {name: (shape, dtype)}, if they fit.

    The check and the allocation happen under an exclusive lock on `lock_path` (default
    `default_lock_path()`), held until every page is resident, so ranks starting together each see
    MemAvailable net of the pools allocated before theirs. Raises `HostMemoryError` (listing each pool,
    the total, the margin and what is available) when total + margin_bytes > available_bytes().
    pin: cudaHostRegister the pools (default: when CUDA is available).
    """
    if pin is None:
        pin = torch.cuda.is_available()
    sizes = {name: pool_bytes(shape, dtype) for name, (shape, dtype) in specs.items()}
    total = sum(sizes.values())
    with open(lock_path or default_lock_path(), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        available = available_bytes()
        if total + margin_bytes > available:
            listing = "\n".join(f"  {name}: {size:,} B" for name, size in sizes.items())
            raise HostMemoryError(
                f"host pools need {total:,} B in all, plus a safety margin of {margin_bytes:,} B, but only "
                f"{available:,} B of RAM is available (MemAvailable); short by "
                f"{total + margin_bytes - available:,} B. Lower the context length or batch the pools are "
                f"sized for, or free host memory. The pools:\n{listing}"
            )
        pools: dict[str, HostPool] = {}
        try:
            for name, (shape, dtype) in specs.items():
                pools[name] = HostPool(shape, dtype, pin=pin)
        except BaseException:
            for pool in pools.values():
                pool.close()
            raise
    logger.info("host pools: %d pools, %s B committed%s", len(pools), f"{total:,}", ", pinned" if pin else "")
    return pools
