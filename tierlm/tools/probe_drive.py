"""`tierlm probe-drive PATH`: random-read latency of the drive that will hold the n-gram table.

Decode reads a few hundred table rows per token from NVMe, so what matters is the tail of 4 KiB random
reads and whether the drive stalls (garbage collection, thermal throttling), not its sequential bandwidth.
The probe times O_DIRECT `preadv` calls into a page-aligned (mmap) buffer at random block-aligned offsets,
first at queue depth 1, then with Q threads each keeping one read in flight, and reports percentiles,
IOPS and stalls: 100 ms windows whose median latency exceeds 10x the run's p50 (and 1 ms), or in which no
read completed at all, merged into ranges. Where O_DIRECT is refused (tmpfs, overlayfs) it falls back to
buffered reads after `posix_fadvise(DONTNEED)` and says so: the figures then include page-cache hits.
It owns this measurement only; the engine's read path lives in `tierlm.memory`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
import re
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tierlm.cli import CliError

WINDOW_S = 0.1
STALL_FACTOR = 10.0
STALL_FLOOR_S = 1e-3  # a window is never a stall below this median (RAM-speed files: Python noise)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'4G', '512M', '64k', '4096' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4G, 512M, 4096)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


@dataclass(frozen=True)
class Stall:
    start_s: float  # from the start of the run
    duration_s: float
    worst_latency_us: float


@dataclass(frozen=True)
class DepthResult:
    queue_depth: int
    reads: int
    seconds: float
    iops: float
    p50_us: float
    p99_us: float
    p999_us: float
    max_us: float
    stalls: list[Stall]


def create_file(path: Path, size: int) -> None:
    """Write `size` bytes of non-zero pseudo-random data (really allocated, not sparse), then fsync."""
    piece = np.random.default_rng(0).integers(1, 256, 16 << 20, dtype=np.uint8)
    written = 0
    with open(path, "wb") as f:
        while written < size:
            n = min(len(piece), size - written)
            f.write(memoryview(piece[:n]))
            written += n
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def open_for_probe(path: Path, block: int, buffered: bool) -> tuple[int, str | None]:
    """(fd, None) for O_DIRECT, or (fd, why) when falling back to buffered reads."""
    if not buffered:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            why = f"O_DIRECT refused by the filesystem ({exc.strerror})"
        else:
            buf = mmap.mmap(-1, block)
            try:
                os.preadv(fd, [buf], 0)
                return fd, None
            except OSError as exc:  # overlayfs opens with O_DIRECT but fails the read
                os.close(fd)
                why = f"O_DIRECT reads refused ({exc.strerror}; filesystem or a block below its sector size)"
            finally:
                buf.close()
    else:
        why = "--buffered asked for"
    return os.open(path, os.O_RDONLY), why


def _reader(fd: int, block: int, blocks: int, deadline: float, seed: int, out: list, errors: list) -> None:
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    rng = np.random.default_rng(seed)
    starts, ends = [], []
    clock, read = time.perf_counter, os.preadv
    try:
        while not ends or ends[-1] < deadline:
            for offset in (rng.integers(0, blocks, 1024) * block).tolist():
                t0 = clock()
                read(fd, [buf], offset)
                t1 = clock()
                starts.append(t0)
                ends.append(t1)
                if t1 >= deadline:
                    break
        out.append((starts, ends))
    except OSError as exc:
        errors.append(exc)
    finally:
        buf.close()


def run_depth(fd: int, size: int, block: int, depth: int, seconds: float, seed: int = 0) -> DepthResult:
    """Random reads of `block` bytes at `depth` threads for `seconds`; latencies and stalls."""
    blocks = size // block
    begin = time.perf_counter()
    results: list = []
    errors: list[OSError] = []
    threads = [
        threading.Thread(
            target=_reader, args=(fd, block, blocks, begin + seconds, seed * 1000 + i, results, errors)
        )
        for i in range(depth)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    starts = np.concatenate([np.asarray(s) for s, _ in results]) - begin
    ends = np.concatenate([np.asarray(e) for _, e in results]) - begin
    elapsed = float(ends.max())
    latency_us = (ends - starts) * 1e6
    p50, p99, p999 = np.percentile(latency_us, [50, 99, 99.9])
    return DepthResult(
        queue_depth=depth,
        reads=len(latency_us),
        seconds=elapsed,
        iops=len(latency_us) / elapsed,
        p50_us=float(p50),
        p99_us=float(p99),
        p999_us=float(p999),
        max_us=float(latency_us.max()),
        stalls=find_stalls(starts, ends, float(p50) * 1e-6),
    )


def find_stalls(starts: np.ndarray, ends: np.ndarray, p50_s: float) -> list[Stall]:
    """Windows (by completion time) with median latency > STALL_FACTOR x p50 (and > STALL_FLOOR_S) or no
    completion, merged into ranges."""
    latency = ends - starts
    threshold = max(STALL_FACTOR * p50_s, STALL_FLOOR_S)
    end = float(ends.max())
    windows = int(np.ceil(end / WINDOW_S))
    which = np.minimum((ends / WINDOW_S).astype(np.int64), windows - 1)
    order = np.argsort(which, kind="stable")
    bounds = np.searchsorted(which[order], np.arange(windows + 1))
    stalled = [
        lo == hi or np.median(latency[order[lo:hi]]) > threshold
        for lo, hi in itertools.pairwise(bounds)
    ]
    stalls, w = [], 0
    while w < windows:
        if not stalled[w]:
            w += 1
            continue
        first = w
        while w < windows and stalled[w]:
            w += 1
        lo, hi = first * WINDOW_S, min(w * WINDOW_S, end)
        overlapping = latency[(starts < hi) & (ends > lo)]
        stalls.append(Stall(lo, hi - lo, float(overlapping.max()) * 1e6 if len(overlapping) else 0.0))
    return stalls


def _print_result(r: DepthResult) -> None:
    print(
        f"QD {r.queue_depth:>3}: {r.reads:>9,} reads in {r.seconds:5.1f} s  {r.iops:>10,.0f} IOPS  "
        f"p50 {r.p50_us:8.1f} us  p99 {r.p99_us:8.1f} us  p99.9 {r.p999_us:9.1f} us  max {r.max_us:10.1f} us"
    )
    if not r.stalls:
        print(f"        no stalls (100 ms windows with median > {STALL_FACTOR:g}x p50 and > 1 ms, or idle)")
    for s in r.stalls:
        print(
            f"        stall at {s.start_s:6.1f} s for {s.duration_s * 1e3:7.0f} ms, worst read "
            f"{s.worst_latency_us / 1e3:8.1f} ms"
        )


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "probe-drive",
        help="random-read latency (p50/p99/p99.9/max), IOPS and stalls of a drive, O_DIRECT",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("path", type=Path, help="a file on the drive (e.g. the PLE table file)")
    parser.add_argument(
        "--create-size",
        type=parse_size,
        metavar="SIZE",
        help="create PATH with this size (e.g. 4G) if it does not exist",
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="per queue depth (default 10)")
    parser.add_argument(
        "--queue-depth",
        type=int,
        default=32,
        metavar="Q",
        help="threads with one read in flight each, for the second run (default 32)",
    )
    parser.add_argument("--block", type=parse_size, default=4096, help="read size, a multiple of 512 (4096)")
    parser.add_argument(
        "--buffered", action="store_true", help="skip O_DIRECT: buffered reads after DONTNEED"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    block = args.block
    if block <= 0 or block % 512:
        raise CliError(f"--block {block} must be a positive multiple of 512 bytes")
    if not args.seconds > 0:
        raise CliError(f"--seconds {args.seconds:g} must be positive")
    if args.queue_depth < 1:
        raise CliError(f"--queue-depth {args.queue_depth} must be at least 1")
    path: Path = args.path
    if not path.exists():
        if args.create_size is None:
            raise CliError(f"{path} does not exist; pass --create-size SIZE (e.g. 4G) to create it")
        if args.create_size < block:
            raise CliError(f"--create-size {args.create_size} is smaller than one block ({block} bytes)")
        if not args.json:
            print(f"creating {path} ({args.create_size / 2**30:.2f} GiB of non-zero data) ...", flush=True)
        try:
            create_file(path, args.create_size)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise CliError(f"cannot create {path}: {exc.strerror}") from None
    if not path.is_file():
        raise CliError(f"{path} is not a regular file")
    size = path.stat().st_size
    if size < block:
        raise CliError(f"{path} has {size} bytes, less than one block ({block} bytes)")

    fd, fallback = open_for_probe(path, block, args.buffered)
    results = []
    try:
        if not args.json:
            mode = (
                "O_DIRECT" if fallback is None else f"BUFFERED reads ({fallback}): page-cache hits included"
            )
            print(
                f"{path}: {size / 2**30:.2f} GiB, {block} B random reads, {args.seconds:g} s per depth, "
                f"{mode}"
            )
        for depth in dict.fromkeys([1, args.queue_depth]):
            if fallback is not None:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            try:
                result = run_depth(fd, size, block, depth, args.seconds)
            except OSError as exc:
                raise CliError(f"reading {path} failed: {exc.strerror or exc}") from None
            results.append(result)
            if not args.json:
                _print_result(result)
    finally:
        os.close(fd)
    if args.json:
        print(
            json.dumps(
                {
                    "path": str(path),
                    "size": size,
                    "block": block,
                    "direct": fallback is None,
                    "fallback_reason": fallback,
                    "results": [asdict(r) for r in results],
                },
                indent=2,
            )
        )
    return 0
