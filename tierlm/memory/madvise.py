"""Asking the kernel for pages of a memory-mapped file ahead of use, and asking which are resident.

`PageAdvisor.advise(ranges)` issues MADV_WILLNEED for many (address, length) ranges with as few system
calls as possible: `process_madvise(pidfd, iovec[<=1024], MADV_WILLNEED)` (Linux >= 5.10) hands the
kernel up to 1024 ranges per call, so it can start all their reads at once; the gather that follows
finds the pages resident or in flight. Where process_madvise is refused (EPERM under container seccomp
profiles without CAP_SYS_PTRACE, or ENOSYS on older kernels) it says so once in the log and falls back
to one madvise per range: the same I/O, more CPU. `resident_fraction` samples pages with mincore.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import platform

import numpy as np

logger = logging.getLogger("tierlm")

MADV_WILLNEED = 3
IOV_MAX = 1024
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# process_madvise is 440 on every architecture that uses the generic syscall table and on x86_64
SYS_PROCESS_MADVISE = 440 if platform.machine() in ("x86_64", "aarch64", "riscv64") else None

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


class PageAdvisor:
    """MADV_WILLNEED over many ranges at once; one per process (the pidfd and the fallback flag)."""

    def __init__(self, force_fallback: bool = False) -> None:
        self.use_process_madvise = not force_fallback and SYS_PROCESS_MADVISE is not None
        self.pidfd = None
        if self.use_process_madvise:
            try:
                self.pidfd = os.pidfd_open(os.getpid())
            except (OSError, AttributeError) as exc:
                self._fall_back(f"pidfd_open failed ({exc})")

    def _fall_back(self, why: str) -> None:
        if self.use_process_madvise:
            logger.warning("process_madvise unavailable (%s); advising page ranges one madvise at a time", why)
        self.use_process_madvise = False

    def advise(self, starts: np.ndarray, lengths: np.ndarray) -> None:
        """MADV_WILLNEED for ranges (page-aligned start addresses, lengths in bytes)."""
        count = len(starts)
        # the iovec array is a numpy [count, 2] uint64 array (iov_base, iov_len): no Python loop fills it
        iov = np.empty((count, 2), dtype=np.uint64)
        iov[:, 0], iov[:, 1] = starts, lengths
        done = 0
        while done < count and self.use_process_madvise:
            n = min(IOV_MAX, count - done)
            pointer = ctypes.c_void_p(iov.ctypes.data + done * iov.strides[0])
            result = _libc.syscall(SYS_PROCESS_MADVISE, self.pidfd, pointer, n, MADV_WILLNEED, 0)
            if result < 0:
                err = ctypes.get_errno()
                if err in (errno.EPERM, errno.ENOSYS, errno.EINVAL):
                    self._fall_back(f"{errno.errorcode.get(err, err)}")
                    break
                raise OSError(err, f"process_madvise: {os.strerror(err)}")
            done += n
        for i in range(done, count):
            if _libc.madvise(int(starts[i]), int(lengths[i]), MADV_WILLNEED) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"madvise: {os.strerror(err)}")


def page_ranges(offsets: np.ndarray, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Unique pages touched by rows at byte `offsets` (each row_bytes long), merged into runs.

    Returns (first page, page count) of each run of adjacent pages, ascending.
    """
    first = offsets // PAGE_SIZE
    last = (offsets + row_bytes - 1) // PAGE_SIZE
    if row_bytes <= PAGE_SIZE:  # a row touches its first and maybe the next page
        pages = np.unique(np.concatenate([first, last]))
    else:  # rows longer than a page also cover the pages between
        pages = np.unique(np.concatenate([np.arange(a, b + 1) for a, b in zip(first, last)]))
    if pages.size == 0:
        return pages, pages
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    run_starts = np.concatenate([[0], breaks])
    run_ends = np.concatenate([breaks, [pages.size]])
    return pages[run_starts], run_ends - run_starts


def row_pages(offsets: np.ndarray, row_bytes: int) -> np.ndarray:
    """The first and the last page of each row (no dedup: cheaper than merging for a decode step's rows)."""
    return np.concatenate([offsets // PAGE_SIZE, (offsets + row_bytes - 1) // PAGE_SIZE])


def resident_fraction(address: int, length: int, sample_pages: int = 4096, seed: int = 0) -> float:
    """Share of a mapping's pages in memory, from mincore on a uniform sample of pages."""
    total = -(-length // PAGE_SIZE)
    rng = np.random.default_rng(seed)
    pages = np.unique(rng.integers(0, total, size=min(sample_pages, total)))
    vec = (ctypes.c_ubyte * 1)()
    resident = 0
    for page in pages:
        if _libc.mincore(address + int(page) * PAGE_SIZE, PAGE_SIZE, vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore: {os.strerror(err)}")
        resident += vec[0] & 1
    return resident / len(pages) if len(pages) else 0.0


def resident_pages(address: int, length: int) -> np.ndarray:
    """mincore over a whole range: a boolean per page (for tests and small ranges)."""
    total = -(-length // PAGE_SIZE)
    vec = (ctypes.c_ubyte * total)()
    if _libc.mincore(address, length, vec) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore: {os.strerror(err)}")
    return np.frombuffer(vec, dtype=np.uint8).astype(bool)
