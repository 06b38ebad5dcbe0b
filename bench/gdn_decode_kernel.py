"""A Gated DeltaNet layer's decode step: the Triton kernel (kernels/gated_delta_rule/decode_triton.py)
vs the torch path it replaces (decode.gated_delta_decode), and optionally vs an earlier version of the
kernel module (--baseline), at decode batch sizes, side by side.

At the target model's GDN widths (16 key heads / 48 value heads of 128, conv kernel 4, hidden 2560; a
3.1 MB fp32 state per request), bf16, batches 1, 4 and 16, in one run:
  - the device copy bandwidth (a large copy, bytes read + written / time);
  - the step between in_proj and out_proj: the torch path, the baseline kernels (--baseline), and the
    kernel at its defaults (VALUE_TILE, DECODE_WARPS) and at every other (value tile, warps) of --tiles x
    --warps, each with its time, its bandwidth on the state (read once + written once) as a fraction of
    the copy bandwidth, torch's time over it, and its output's max |diff| / max |torch's|;
  - the whole layer (in_proj, the step, out_proj) with TIERLM_NO_FUSED_GDN_DECODE=1 and without.
Everything is replayed from CUDA graphs, as static decode runs it. Each timed round cycles through
enough distinct state slots that one call's states are not in L2 for the next (in a model, every
other layer's weights pass through L2 between two calls of one layer).

    python bench/gdn_decode_kernel.py                                 # CUDA, the defaults
    python bench/gdn_decode_kernel.py --baseline ../main --tiles 16 32 64 128 --warps 2 4 8
    TRITON_INTERPRET=1 python bench/gdn_decode_kernel.py --small --tiles 8  # CPU: the interpreter, tiny shapes
--baseline ROOT times another checkout's decode_triton.py beside this one's (ROOT may also be a copy of
that file: `git show REV:tierlm/kernels/gated_delta_rule/decode_triton.py > FILE`).
Results go to bench/results/gdn_decode_kernel_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch
from device_timing import copy_bandwidth, device_label, timed

from tierlm.kernels.gated_delta_rule import decode_triton
from tierlm.kernels.gated_delta_rule.decode import gated_delta_decode
from tierlm.model.cache import GDNState
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.layers.gated_deltanet import GatedDeltaNet

KERNEL_FILE = "tierlm/kernels/gated_delta_rule/decode_triton.py"
TARGET = {"hk": 16, "hv": 48, "dk": 128, "dv": 128, "kc": 4, "hidden": 2560}
SMALL = {"hk": 2, "hv": 6, "dk": 16, "dv": 16, "kc": 4, "hidden": 32}
COLD_BYTES = 256 << 20  # state bytes each timed round cycles through (> an H200's 50 MB L2)


def real_layer(shape: dict, dtype: torch.dtype, device: torch.device) -> GatedDeltaNet:
    config = SimpleNamespace(linear_num_key_heads=shape["hk"], linear_num_value_heads=shape["hv"],
                             linear_key_head_dim=shape["dk"], linear_value_head_dim=shape["dv"],
                             linear_conv_kernel_dim=shape["kc"], hidden_size=shape["hidden"], rms_norm_eps=1e-6,
                             output_gate_act="silu")
    layer = GatedDeltaNet(config).to(device=device, dtype=dtype).requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(0)
    for p in layer.parameters():
        p.normal_(0.0, 0.02, generator=gen)
    layer.A_log.uniform_(0.0, 2.0, generator=gen)
    layer.norm.weight.fill_(1.0)
    return layer


def measure_batch(layer: GatedDeltaNet, batch: int, args, device: torch.device, dtype: torch.dtype, copy: float,
                  baseline: ModuleType | None):
    defaults = (decode_triton.VALUE_TILE, decode_triton.DECODE_WARPS)
    state_bytes = layer.num_v_heads * layer.head_k_dim * layer.head_v_dim * 4
    cycles = max(2, math.ceil(args.cold_bytes / (batch * state_bytes)))
    slots_total = cycles * batch + 1
    gen = torch.Generator(device=device).manual_seed(batch)
    conv = torch.randn(slots_total, layer.conv_dim, layer.kernel - 1, generator=gen, device=device).to(dtype)
    recurrent = torch.randn(slots_total, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, generator=gen,
                            device=device) * 0.1
    slot_sets = [torch.arange(i * batch, (i + 1) * batch, device=device) for i in range(cycles)]
    x = torch.randn(batch, layer.in_proj.in_features, generator=gen, device=device).to(dtype)
    mixed, z, b, a = layer.in_proj(x)
    weights = (layer.conv1d.weight.squeeze(1), layer.A_log, layer.dt_bias, layer.norm.weight)

    def step(fn):
        return lambda i: fn(mixed, z, b, a, *weights, conv, recurrent, slot_sets[i], layer.norm.eps, "silu")

    pools = (conv.clone(), recurrent.clone())  # the pools every check starts from (timing moves the real ones on)
    reference = gated_delta_decode(mixed, z, b, a, *weights, *(p.clone() for p in pools), slot_sets[0],
                                   layer.norm.eps, "silu").float()

    def rel_diff(fn) -> float:
        """fn's output vs the torch path's, one step from the same pools."""
        got = fn(mixed, z, b, a, *weights, *(p.clone() for p in pools), slot_sets[0], layer.norm.eps, "silu")
        return ((got.float() - reference).abs().max() / reference.abs().max()).item()

    bytes_per_call = 2 * batch * state_bytes

    def report(form: str, seconds: float, diff: float | None) -> dict:
        print(f"{'':>6} {form:<26}{seconds * 1e6:>10.1f}{bytes_per_call / seconds / copy:>9.1%}"
              f"{torch_s / seconds:>8.2f}x" + ("" if diff is None else f"{diff:>11.1e}"))
        return {"us": seconds * 1e6, "vs_copy": bytes_per_call / seconds / copy, "torch_over": torch_s / seconds,
                "max_rel_diff": diff}

    torch_s = timed(step(gated_delta_decode), cycles, device)
    print(f"{batch:>6} {'torch path':<26}{torch_s * 1e6:>10.1f}{bytes_per_call / torch_s / copy:>9.1%}{'1.00x':>9}")
    row = {"batch": batch, "torch_step_us": torch_s * 1e6, "kernel": []}
    if baseline is not None:
        row["baseline"] = report("baseline kernels", timed(step(baseline.triton_gated_delta_decode), cycles, device),
                                 rel_diff(baseline.triton_gated_delta_decode))
    configs = sorted({defaults, *((t, w) for t in args.tiles or [defaults[0]] for w in args.warps or [defaults[1]])})
    for tile, warps in configs:
        decode_triton.VALUE_TILE, decode_triton.DECODE_WARPS = tile, warps
        seconds = timed(step(decode_triton.triton_gated_delta_decode), cycles, device)
        mark = " (default)" if (tile, warps) == defaults else ""
        result = report(f"tile {tile}, {warps} warps{mark}", seconds, rel_diff(decode_triton.triton_gated_delta_decode))
        row["kernel"].append({"value_tile": tile, "num_warps": warps, **result})
    decode_triton.VALUE_TILE, decode_triton.DECODE_WARPS = defaults
    kernel_us = next(r["us"] for r in row["kernel"] if (r["value_tile"], r["num_warps"]) == defaults)
    best = min(row["kernel"], key=lambda r: r["us"])
    row.update({"kernel_step_us": kernel_us, "torch_over_kernel": torch_s * 1e6 / kernel_us,
                "best": {k: best[k] for k in ("value_tile", "num_warps", "us")}})

    # the whole layer (in_proj, step, out_proj) through the model's path, kill switch on and off
    state = GDNState(conv, recurrent)
    batches = [ForwardBatch.build([[2]] * batch, [0] * batch, s.tolist(), [[0]] * batch, 16, device=device)
               for s in slot_sets]
    layer_s = {}
    for fused in (False, True):
        if fused:
            os.environ.pop("TIERLM_NO_FUSED_GDN_DECODE", None)
        else:
            os.environ["TIERLM_NO_FUSED_GDN_DECODE"] = "1"
        layer_s[fused] = timed(lambda i: layer(x, batches[i], state), cycles, device)
    os.environ.pop("TIERLM_NO_FUSED_GDN_DECODE", None)
    row.update({"layer_torch_us": layer_s[False] * 1e6, "layer_fused_us": layer_s[True] * 1e6,
                "layer_torch_over_fused": layer_s[False] / layer_s[True]})
    print(f"{'':>6} whole layer (in_proj, step, out_proj): torch {layer_s[False] * 1e6:.1f} us, "
          f"fused {layer_s[True] * 1e6:.1f} us, {layer_s[False] / layer_s[True]:.2f}x")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--tiles", type=int, nargs="*", help="value tiles (powers of 2) to time the kernel at")
    parser.add_argument("--warps", type=int, nargs="*", help="warp counts to time the kernel at (x --tiles)")
    parser.add_argument("--baseline", type=Path, metavar="ROOT",
                        help="another checkout (or a copy of its decode_triton.py) whose kernels to time beside")
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU, under TRITON_INTERPRET=1)")
    parser.add_argument("--cold-bytes", type=int, default=COLD_BYTES, help="state bytes cycled through per round")
    args = parser.parse_args()
    for tile in args.tiles or []:
        if tile < 1 or tile & (tile - 1):
            parser.error(f"--tiles: {tile} is not a power of 2")
    device, dtype = torch.device(args.device), torch.bfloat16
    baseline = None
    if args.baseline is not None:
        from kernel_baseline import load_baseline_module

        baseline = load_baseline_module(args.baseline, KERNEL_FILE)
    if args.small:
        args.cold_bytes = 0
    shape = SMALL if args.small else TARGET
    name = device_label(device)
    copy = copy_bandwidth(device, 2 << 30 if device.type == "cuda" else 16 << 20)
    layer = real_layer(shape, dtype, device)
    print(f"{name}: GDN {shape}, bf16; copy bandwidth {copy / 1e9:.0f} GB/s (read + write)")
    print(f"{'batch':>6} {'form':<26}{'us/call':>10}{'of copy':>9}{'torch/x':>9}{'rel diff':>11}")
    rows = [measure_batch(layer, batch, args, device, dtype, copy, baseline) for batch in args.batches]
    print("\nbatch  torch step    baseline  kernel step  base/kernel  best (tile, warps)  |  torch layer  fused layer"
          "    ratio")
    for r in rows:
        base, best = r.get("baseline"), r["best"]
        base_us = f"{base['us']:.1f}" if base else "-"
        speedup = f"{base['us'] / r['kernel_step_us']:.2f}x" if base else "-"
        print(f"{r['batch']:>5} {r['torch_step_us']:>11.1f} {base_us:>11} {r['kernel_step_us']:>12.1f} {speedup:>12}"
              f"  {best['us']:>7.1f} ({best['value_tile']:>3}, {best['num_warps']:>2})  |"
              f" {r['layer_torch_us']:>12.1f} {r['layer_fused_us']:>12.1f} {r['layer_torch_over_fused']:>7.2f}x")
    out = Path(__file__).parent / "results" / f"gdn_decode_kernel_{name}.json"
    out.write_text(json.dumps({"device": name, "shape": shape, "copy_bandwidth": copy,
                               "baseline": None if args.baseline is None else str(args.baseline),
                               "defaults": {"value_tile": decode_triton.VALUE_TILE,
                                            "num_warps": decode_triton.DECODE_WARPS}, "results": rows}, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
