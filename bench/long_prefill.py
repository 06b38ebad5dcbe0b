"""Long-prompt prefill throughput: tok/s at 8k vs 128k context, the Triton prefill kernels vs the torch paths.

A 4-layer mixer stack at the target model's widths (docs: qwen4-exp-architecture.md section 14): hidden 2560,
three Gated DeltaNet layers (16 key / 48 value heads of 128) and one QSA layer (24 query heads, 2 KV heads of
256, partial rotary 0.25, indexer budget 2048 over blocks of R = 4; the indexer's head count and width are
not pinned down there: --indexer-heads, --indexer-dim). Random weights; each layer adds its output to the
residual stream (no MoE: its cost per token does not depend on the context). One prompt per context length
is prefilled in chunks of --chunk tokens (what the scheduler hands the model), and its tok/s is the prompt
length over the whole prefill's time, with the time of each layer kind beside it and, in parentheses,
the part of the QSA time its indexer took (block scores and top-k: O(context) per query on both paths). The two paths are the
kernels (default on CUDA) and the torch paths (TIERLM_NO_TRITON_GDN_PREFILL=1, TIERLM_NO_TRITON_QSA_PREFILL=1,
TIERLM_NO_FUSED_QSA_SELECT=1).
The issue's target: tok/s at 128k >= 50% of tok/s at 8k. Results go to bench/results/long_prefill_<device>.txt.

    python bench/long_prefill.py --device cuda                       # H200: real widths, 8k vs 128k
    python bench/long_prefill.py --small --contexts 512 4096 --chunk 512    # CPU: small widths, torch only
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import time
from pathlib import Path

import torch
from torch import nn

from tierlm.config import ModelConfig
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.layers.gated_deltanet import GatedDeltaNet
from tierlm.model.layers.qsa_attention import QSAAttention
from tierlm.model.layers.rotary import Rope, RotaryEmbedding
from tierlm.model.model_cache import ModelCache

ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 64
KILL_SWITCHES = ("TIERLM_NO_TRITON_GDN_PREFILL", "TIERLM_NO_TRITON_QSA_PREFILL", "TIERLM_NO_FUSED_QSA_SELECT")
LAYER_TYPES = ("linear_attention",) * 3 + ("indexed_attention",)
WIDTHS = {
    "real": {"hidden_size": 2560, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
             "linear_key_head_dim": 128, "linear_value_head_dim": 128, "num_attention_heads": 24,
             "num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25, "indexer_budget": 2048},
    "small": {"hidden_size": 256, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
              "linear_value_head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "partial_rotary_factor": 0.25, "indexer_budget": 256},
}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return f"cpu-{platform.machine()}"


def build_stack(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> list[nn.Module]:
    """The mixers of LAYER_TYPES with random weights scaled so that each output is O(1)."""
    gen = torch.Generator().manual_seed(0)
    layers = []
    for kind in config.layer_types:
        layer = GatedDeltaNet(config) if kind == "linear_attention" else QSAAttention(config)
        with torch.no_grad():
            for name, param in layer.named_parameters():
                if param.dim() >= 2:
                    fan_in = param.shape[-1] if param.dim() == 2 else param.shape[-1] * param.shape[1]
                    param.copy_(torch.randn(param.shape, generator=gen) * fan_in**-0.5)
        layers.append(layer.to(device=device, dtype=dtype))
    return layers


def time_indexer(layers, seconds: dict[str, float], sync) -> None:
    """Add the QSA layers' block scoring and top-k choice (the work that grows with the context, the same on
    both paths) to seconds["indexer"]: their methods wrapped on the instances, a device sync around each call."""

    def timed(method):
        def call(*args):
            sync()
            began = time.perf_counter()
            result = method(*args)
            sync()
            seconds["indexer"] += time.perf_counter() - began
            return result

        return call

    for layer in layers:
        if isinstance(layer, QSAAttention):
            layer.indexer.scores = timed(type(layer.indexer).scores.__get__(layer.indexer))
            layer.indexer.select = timed(type(layer.indexer).select.__get__(layer.indexer))


def prefill(layers, config: ModelConfig, cache: ModelCache, rotary, length: int, chunk: int) -> dict[str, float]:
    """Seconds to prefill one `length`-token prompt in chunks of `chunk` (slot 0, blocks 0..), in total and
    per layer kind (each layer timed alone: a device sync around it), and the QSA indexer's share."""
    device = cache.device
    cache.reset_slot(0)
    table = list(range(math.ceil(length / BLOCK_SIZE)))
    gen = torch.Generator(device=device).manual_seed(1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds = {"total": 0.0, "linear_attention": 0.0, "indexed_attention": 0.0, "indexer": 0.0}
    time_indexer(layers, seconds, sync)
    for start in range(0, length, chunk):
        n = min(chunk, length - start)
        batch = ForwardBatch.build([[3] * n], [start], [0], [table], BLOCK_SIZE, device=device)
        x = torch.randn(n, config.hidden_size, generator=gen, device=device, dtype=cache.dtype)
        rope = Rope(rotary, batch, x.dtype)
        for layer, kind, caches in zip(layers, config.layer_types, cache.layers):
            sync()
            began = time.perf_counter()
            if kind == "linear_attention":
                out = layer(x, batch, caches.gdn)
            else:
                out = layer(x, batch, caches.kv, caches.indexer, rope)
            x = x + out
            sync()
            seconds[kind] += time.perf_counter() - began
    seconds["total"] = seconds["linear_attention"] + seconds["indexed_attention"]
    return seconds


def set_path(kernels: bool) -> None:
    for name in KILL_SWITCHES:
        if kernels:
            os.environ.pop(name, None)
        else:
            os.environ[name] = "1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--small", action="store_true", help="small widths (a CPU run)")
    parser.add_argument("--contexts", type=int, nargs=2, default=[8192, 131_072])
    parser.add_argument("--chunk", type=int, default=8192, help="prefill chunk (the scheduler's token budget)")
    parser.add_argument("--indexer-heads", type=int, default=16)
    parser.add_argument("--indexer-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many prefills per cell")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (one: steadier on a shared machine)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    widths = "small" if args.small else "real"
    short, long = args.contexts
    if short <= 0 or long <= 0 or args.chunk <= 0:
        parser.error("--contexts and --chunk must be positive")
    config = ModelConfig(
        **WIDTHS[widths], num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES, indexer_n_heads=args.indexer_heads,
        indexer_kv_heads=1, indexer_head_dim=args.indexer_dim, indexer_compress_ratio=4, max_position_embeddings=long,
        num_experts=8, num_experts_per_tok=2,
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    paths = {"torch": False, "kernels": True} if device.type == "cuda" else {"torch": False}
    results: dict[tuple[str, int], dict[str, float]] = {}
    with torch.inference_mode():
        layers = build_stack(config, device, dtype)
        rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta)
        cache = ModelCache(config, 1, math.ceil(long / BLOCK_SIZE), BLOCK_SIZE, dtype, device)
        for path, kernels in paths.items():
            set_path(kernels)
            prefill(layers, config, cache, rotary, min(short, 2 * args.chunk), args.chunk)  # warm-up, compiles
            for length in (short, long):
                runs = [prefill(layers, config, cache, rotary, length, args.chunk) for _ in range(args.repeats)]
                results[path, length] = min(runs, key=lambda r: r["total"])
    lines = [
        (f"{widths} widths (hidden {config.hidden_size}; 3 GDN + 1 QSA) on {device_name(device)}, {str(dtype)[6:]}, "
         f"chunks of {args.chunk}: prefill of one prompt, best of {args.repeats}"),
        f"{'context':>9}" + "".join(f"{f'{p} tok/s':>15}{'GDN s':>9}{'QSA s':>9}{'(index)':>9}" for p in paths)
        + ("" if len(paths) == 1 else f"{'kernels/torch':>15}"),
    ]
    for length in (short, long):
        row = f"{length:>9,}"
        for path in paths:
            r = results[path, length]
            row += (f"{length / r['total']:>15,.0f}{r['linear_attention']:>9.3f}{r['indexed_attention']:>9.3f}"
                    f"{r['indexer']:>9.3f}")
        if len(paths) > 1:
            row += f"{results['torch', length]['total'] / results['kernels', length]['total']:>15.2f}"
        lines.append(row)
    ratio = {p: (long / results[p, long]["total"]) / (short / results[p, short]["total"]) for p in paths}
    lines.append(f"{f'{long / 1024:g}k/{short / 1024:g}k':>9}" + "".join(f"{ratio[p]:>15.3f}{'':>27}" for p in paths)
                 + "   (tok/s ratio; target >= 0.5)")
    print("\n".join(lines))
    out = ROOT / "bench" / "results" / f"long_prefill_{device_name(device)}{'_small' if args.small else ''}.txt"
    out.write_text("\n".join(lines) + "\n")
    print(f"saved {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
