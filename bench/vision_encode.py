"""Encoding one image with the vision tower resident vs streamed from host memory (--mm-encoder-offload).

The tower at the real ViT widths (27 blocks x 1152, merger to 2560; random weights, --dtype) encodes a
--image-size square image (random patches: 1024 x 1024 is a 64 x 64 patch grid, 1,024 features). First
resident (the weights on the device), then the same tower after `stream_from_host` (each unit's weights in
pinned host memory, copied into one of two device slots on a side stream one unit ahead of its compute).
Printed side by side: milliseconds per encode (median of --repeats, after two warm-ups) and their ratio
(issue 17's target: streamed <= 1.3x resident), the host-to-device copy of every unit alone (what the
streamed encode hides behind compute), the device bytes the tower holds between requests (allocated after
the encode returned, less the allocated before the tower was built and the features this script keeps;
this includes what the first GEMMs allocate once for good, e.g. cuBLAS's workspace), of them the tower's
own parameters and buffers on the device (target 0 when streamed), the peak
during an encode above that, and whether the two give the same features bit for bit.
Results go to bench/results/vision_encode_<device>.json.

    python bench/vision_encode.py --small                    # CPU, a small tower (seconds)
    python bench/vision_encode.py --device cuda              # H200: real widths, 1024 x 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from device_timing import device_label

from tierlm.config import VisionConfig
from tierlm.model.vision.tower import VisionTower

REAL = VisionConfig(out_hidden_size=2560)  # 27 x 1152, 16 heads, MLP 4304, patch 16, merge 2
SMALL = VisionConfig(depth=4, hidden_size=64, num_heads=4, intermediate_size=128, out_hidden_size=96,
                     num_position_embeddings=64)


def nbytes(*tensors: torch.Tensor) -> int:
    """Device bytes of tensors (0 on CPU, where `allocated` counts nothing)."""
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cuda")


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def median_ms(fn, device: torch.device, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def random_tower(config: VisionConfig, dtype: torch.dtype, device: torch.device) -> VisionTower:
    torch.manual_seed(0)
    with torch.device(device):
        tower = VisionTower(config).to(dtype).eval()
    with torch.no_grad():
        for param in tower.parameters():
            param.normal_(0.0, 0.02)
    return tower


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--image-size", type=int, default=None, help="square side in pixels (default 1024; --small: 128)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="a 4-block 64-wide tower (CPU smoke run)")
    parser.add_argument("--out", default=None, help="results JSON (default bench/results/vision_encode_<device>.json)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = SMALL if args.small else REAL
    side = args.image_size or (128 if args.small else 1024)
    unit = config.patch_size * config.spatial_merge_size
    if side % unit:
        raise SystemExit(f"--image-size must be a multiple of {unit} (patch x merge)")
    grid = (1, side // config.patch_size, side // config.patch_size)
    patches = torch.randn(grid[1] * grid[2], config.patch_values, generator=torch.Generator().manual_seed(1))
    patches = patches.to(device, dtype)
    before = allocated(device)

    tower = random_tower(config, dtype, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in tower.parameters())
    with torch.no_grad():
        resident_out = tower(patches, [grid])
        resident_ms = median_ms(lambda: tower(patches, [grid]), device, args.repeats)
        # the bytes held beyond the features this script keeps for the bit-for-bit comparison
        resident_held = allocated(device) - before - nbytes(resident_out)
        resident_weights = nbytes(*tower.parameters(), *tower.buffers())
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        tower(patches, [grid])
        resident_peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0) - before

        tower.stream_from_host(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        streamed_out = tower(patches, [grid])
        streamed_ms = median_ms(lambda: tower(patches, [grid]), device, args.repeats)
        streamed_held = allocated(device) - before - nbytes(resident_out, streamed_out)
        streamed_weights = nbytes(*tower.parameters(), *tower.buffers())
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        tower(patches, [grid])
        streamed_peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0) - before
        units = tower.streamed.units
        slot = torch.empty(tower.streamed.slot_numel, dtype=dtype, device=device)
        copy_ms = median_ms(lambda: [slot[: u.host.numel()].copy_(u.host, non_blocking=True) for u in units],
                            device, args.repeats)
    host_bytes = tower.streamed.host_bytes
    same = torch.equal(streamed_out, resident_out)
    result = {
        "device": device_label(device), "dtype": args.dtype, "image": [side, side], "grid": list(grid),
        "features": list(resident_out.shape), "depth": config.depth, "hidden_size": config.hidden_size,
        "out_hidden_size": config.out_hidden_size, "weight_bytes": weight_bytes, "host_bytes": host_bytes,
        "resident_ms": resident_ms, "streamed_ms": streamed_ms, "ratio": streamed_ms / resident_ms,
        "copy_all_units_ms": copy_ms, "copy_gb_per_s": host_bytes / copy_ms / 1e6,
        "device_bytes_between_requests": {"resident": resident_held, "streamed": streamed_held},
        "tower_weight_bytes_on_device": {"resident": resident_weights, "streamed": streamed_weights},
        "peak_bytes_during_encode": {"resident": resident_peak, "streamed": streamed_peak},
        "bit_identical": same, "torch": torch.__version__,
    }
    print(f"vision tower {config.depth} x {config.hidden_size} -> {config.out_hidden_size}, {args.dtype}, "
          f"{side} x {side} image ({grid[1]} x {grid[2]} patches, {resident_out.shape[0]:,} features) on "
          f"{result['device']}; weights {weight_bytes:,} B")
    print(f"{'':34}{'resident':>14}{'streamed':>14}{'ratio':>8}")
    print(f"{'encode (ms, median)':34}{resident_ms:14.2f}{streamed_ms:14.2f}{streamed_ms / resident_ms:8.2f}")
    print(f"{'device bytes between requests':34}{resident_held:14,}{streamed_held:14,}")
    print(f"{'  of them the tower weights':34}{resident_weights:14,}{streamed_weights:14,}")
    print(f"{'peak bytes above that in encode':34}{resident_peak:14,}{streamed_peak:14,}")
    print(f"copy of every unit alone: {copy_ms:.2f} ms ({result['copy_gb_per_s']:.1f} GB/s); features equal bit "
          f"for bit: {same}")
    out = Path(args.out or Path(__file__).parent / "results" / f"vision_encode_{result['device']}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
