"""Does programmatic dependent launch (PDL) pay for a chain of small GEMVs replayed from one CUDA graph?

60 dependent bf16 GEMVs (each reads the previous one's output) captured in one graph, in three forms:
  0: plain launches;
  1: PDL, each kernel waiting for its predecessor first and loading its weights after;
  2: PDL, each kernel loading its weights first, then letting its successor start, then waiting
     (the form `tierlm/kernels/dependent_launch.py` prescribes).
Prints microseconds per kernel and the speed-up over form 0, per GEMV size. GPU of compute capability 9+
only (PDL does not exist elsewhere). Results: bench/results/pdl_probe_<device>.txt.

    python bench/pdl_probe.py
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

KERNELS = 60
SHAPES = ((1024, 1024), (2560, 1024), (256, 1024))  # rows x K of each GEMV
BLOCK_ROWS = 8


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, y_ptr, K: tl.constexpr, BLOCK_R: tl.constexpr, MODE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, K)
    if MODE == 2:
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :])  # weights before the wait
        gdc_launch_dependents()
        gdc_wait()
    else:
        if MODE == 1:
            gdc_wait()
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :])
    x = tl.load(x_ptr + cols).to(tl.float32)
    y = tl.sum(w.to(tl.float32) * x[None, :], 1)
    tl.store(y_ptr + rows, (y * 1e-3).to(tl.bfloat16))


def us_per_kernel(rows: int, k: int, mode: int) -> float:
    """The chain's graph replay time divided by its kernels, in microseconds."""
    weights = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _ in range(KERNELS)]
    vectors = [torch.randn(max(rows, k), device="cuda", dtype=torch.bfloat16) for _ in range(KERNELS + 1)]

    def chain():
        for i in range(KERNELS):
            _gemv_kernel[(rows // BLOCK_ROWS,)](weights[i], vectors[i], vectors[i + 1], K=k, BLOCK_R=BLOCK_ROWS,
                                                MODE=mode, num_warps=4, launch_pdl=mode > 0)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for _ in range(20):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 200 / KERNELS * 1000


def main() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("pdl_probe: needs a GPU of compute capability 9 or more (programmatic dependent launch)")
    device = torch.cuda.get_device_name()
    lines = [f"{device}, torch {torch.__version__}, triton {triton.__version__}; {KERNELS} dependent GEMVs in one graph"]
    for rows, k in SHAPES:
        times = {mode: us_per_kernel(rows, k, mode) for mode in (0, 1, 2)}
        lines.append(f"{rows}x{k} bf16 ({rows * k * 2 / 1e6:.1f} MB each): " + ", ".join(
            f"form {mode} {us:.2f} us/kernel ({times[0] / us:.2f}x)" for mode, us in times.items()))
    print("\n".join(lines))
    out = Path(__file__).parent / "results" / f"pdl_probe_{device.lower().replace(' ', '_')}.txt"
    out.write_text("\n".join(lines) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
