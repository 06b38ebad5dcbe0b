"""Timing helpers the kernel benches share (imported as a sibling module: run the benches as scripts).

`timed`: seconds per call of fn(i), i in range(calls), replayed from one CUDA graph (or eagerly), best of 5
rounds; on a CPU one plain pass after a warm-up call. `copy_bandwidth`: the device's copy bandwidth, the
bytes read plus the bytes written of a large eager copy per second, best of 12 (a graph replays a copy as
a memcpy node, slower than the copy kernel). `copy_floor`: seconds per call of the copy kernel moving a
small kernel's bytes in its own launches (a small read never reaches the large copy's bandwidth: the launch's
ramp and tail weigh). `cuda_events`: the CUDA kernels one eager call of fn launches (profiled), in launch
order; `kernels_per_call`: how many. `device_label`: the device's name in results files.
"""

from __future__ import annotations

import platform
import time

import torch


def timed(fn, calls: int, device: torch.device, use_graph: bool = True) -> float:
    if device.type != "cuda":
        fn(0)  # warm-up
        start = time.perf_counter()
        for i in range(calls):
            fn(i)
        return (time.perf_counter() - start) / calls
    for i in range(calls):  # warm-up: compilation, allocator
        fn(i)
    torch.cuda.synchronize()
    graph = None
    if use_graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if graph is not None:
            graph.replay()
        else:
            for i in range(calls):
                fn(i)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return best / calls


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    if device.type != "cuda":
        return 2 * nbytes / timed(lambda i: dst.copy_(src), 1, device)
    dst.copy_(src)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return 2 * nbytes / best


def copy_floor(moved: list[int], calls: int, device: torch.device, use_graph: bool = True) -> float:
    """Seconds per call of one copy per entry of `moved`, in order, each moving that many bytes (half read,
    half written, as `copy_bandwidth` counts them), from `calls` distinct sets of buffers (as a kernel timed
    over `calls` routings reads distinct weights: nothing served from L2), timed as `timed` times a kernel.
    At these sizes the copy kernel's own speed does not follow the size smoothly: on an
    H100, one launch moving 25.34 MB reached 67% of the copy bandwidth, 27.65 MB 77%, the same in runs
    with the lengths rounded to 256 values."""
    pairs = [[(src := torch.empty(max(1, n // 4), dtype=torch.bfloat16, device=device).normal_(),
               torch.empty_like(src)) for n in moved] for _ in range(calls)]

    def copies(i: int) -> None:
        for src, dst in pairs[i]:
            dst.copy_(src)

    return timed(copies, calls, device, use_graph)


def device_label(device: torch.device) -> str:
    """The device's name as results files carry it (e.g. nvidia-h200, cpu-x86_64)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-").lower()
    return f"cpu-{platform.machine()}"


def cuda_events(fn) -> list:
    """The profiler's events of the CUDA kernels one call of fn() launches, in launch order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def kernels_per_call(fn) -> int:
    return len(cuda_events(fn))
