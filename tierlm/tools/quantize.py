"""`tierlm quantize MODEL --out DIR --scheme int4-mixed`: a compressed-tensors checkpoint from a bf16 one.

Round-to-nearest symmetric integer quantization with a per-group clip search: for each group of
`group_size` inputs of a row (or the whole row, per-channel), candidate scales max|w| * r / (2^(bits-1) - 1)
for r = 1, 0.975, ..., 0.525 are tried (each rounded to the checkpoint's dtype first, as it is stored) and
the one with the least squared error of the dequantized group is kept; r = 1 is plain round-to-nearest,
which wins ties, so the search is never worse. `--no-clip-search` keeps r = 1.

Schemes (the module names the config groups target are tierlm's checkpoint names):
- `int4-mixed` (the seed's deployment): INT4 routed experts (group `--group-size`), INT6 shared expert
  (same groups), INT8 per-channel embedding, lm_head and hyper-connection down/up projections (and the
  injection gate stored with the down projection: they run as one matrix), bf16 for the rest;
- `int8`: every linear and the embedding INT8 per-channel except the router (gate + shared-expert gate);
- `int4`: INT4 routed experts only.
An MTP draft head (`mtp.*`) is carried along and quantized by the same rules (its experts, shared expert
and hyper-connections match the same patterns).
`--ignore PATTERN` (a module name or `re:<regex>`, repeatable) keeps more modules unquantized.
A model with `tie_word_embeddings` has one table for its embedding and lm_head: it is quantized and
written once, as `model.embed_tokens` (as transformers saves tied weights; the config's groups target
both, and the loader's lm_head runs on it), so the scheme must give both one format (ignore both or none).

Output: config.json with a `quantization_config` as llm-compressor writes it (quant_method
compressed-tensors, format pack-quantized, config_groups with targets, ignore), the tensors in
`model-00001-of-00003.safetensors`-style shards with an index, and the other files of MODEL
(tokenizer, generation config) copied. It streams: one tensor is read, quantized (in row chunks) and queued for the current
output shard, which is written once it reaches `--max-shard-bytes`; memory stays about one shard plus one
tensor, whatever the checkpoint's size.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierlm.cli import CliError

SCHEMES = ("int4-mixed", "int8", "int4")
CLIP_RATIOS = tuple(1.0 - 0.025 * i for i in range(20))
ROUNDING_MAGIC = 1.5 * 2**23
CHUNK_VALUES = 1 << 22  # weight values quantized per step (bounds the search's temporaries)
EXPERTS = r"re:.*mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"
SHARED_EXPERT = r"re:.*mlp\.shared_expert\.(gate_proj|up_proj|down_proj)$"
HYPER_CONNECTION = r"re:.*hyper_connection(_mixer)?\.(input_mix_weight_down|input_mix_weight_up|block_inject_weight)$"
ROUTER = r"re:.*mlp\.(gate|shared_expert_gate)$"


@dataclass
class QuantizedWeight:
    """A weight [N, K] as the quantizer leaves it: signed integers, scales [N, groups] in the checkpoint
    dtype, and its own dequantization (q * scale in fp32), which loading must reproduce exactly."""

    signed: Any  # torch.int8 [N, K]
    scale: Any
    dequantized: Any  # fp32 [N, K]


def quantize_weight(weight, bits: int, group_size: int | None, clip_search: bool = True) -> QuantizedWeight:
    """Symmetric quantization of `weight` [N, K] to `bits` with one scale per `group_size` inputs
    (None: per row), scales in the weight's dtype, with the clip search (see the module docstring)."""
    import torch

    n, k = weight.shape
    width = k if group_size is None else group_size
    if k % width:
        raise ValueError(f"group size {group_size} does not divide the {k} input columns")
    qmax, qmin = (1 << (bits - 1)) - 1, -(1 << (bits - 1))
    ratios = CLIP_RATIOS if clip_search else (1.0,)
    signed = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // width, dtype=weight.dtype)
    dequantized = torch.empty(n, k, dtype=torch.float32)
    rows = max(1, CHUNK_VALUES // k)
    for start in range(0, n, rows):
        w = weight[start : start + rows].float().unflatten(-1, (-1, width))  # [r, G, width]
        absmax = w.abs().amax(dim=-1)
        best_err = torch.full(absmax.shape, math.inf)
        best_scale = torch.ones(absmax.shape, dtype=weight.dtype)
        for ratio in ratios:
            scale = (absmax * ratio / qmax).to(weight.dtype)
            scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # all-zero group: any scale
            s = scale.float().unsqueeze(-1)
            err = ((_round(torch.clamp(w / s, qmin, qmax)) * s - w) ** 2).sum(dim=-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, scale, best_scale)
        s = best_scale.float().unsqueeze(-1)
        q = _round(torch.clamp(w / s, qmin, qmax))
        signed[start : start + rows] = q.to(torch.int8).flatten(-2)
        scales[start : start + rows] = best_scale
        dequantized[start : start + rows] = (q * s).flatten(-2)
    return QuantizedWeight(signed, scales, dequantized)


def _round(x):
    """Round half to even, as torch.round, for fp32 |x| < 2^22: adding and subtracting 1.5 * 2^23 leaves
    no fraction bits (measured 40x faster than torch.round on the CPUs here)."""
    return (x + ROUNDING_MAGIC) - ROUNDING_MAGIC


def _group(name: str, targets: list[str], bits: int, group_size: int | None) -> tuple[str, dict[str, Any]]:
    from tierlm.model.quantization.compressed_tensors import PACK_QUANTIZED, PackQuantizedFormat

    weights = PackQuantizedFormat(bits, group_size).scheme_dict()
    return name, {
        "targets": targets, "weights": weights, "input_activations": None, "output_activations": None,
        "format": PACK_QUANTIZED,
    }


def scheme_config(scheme: str, group_size: int, ignore: list[str]) -> dict[str, Any]:
    """The `quantization_config` section of `scheme`."""
    if scheme == "int4-mixed":
        groups = [
            _group("group_0", [EXPERTS], 4, group_size),
            _group("group_1", [SHARED_EXPERT], 6, group_size),
            _group("group_2", [r"re:.*embed_tokens$", "lm_head", HYPER_CONNECTION], 8, None),
        ]
    elif scheme == "int8":
        groups = [_group("group_0", ["Linear", "Embedding"], 8, None)]
        ignore = [ROUTER, *ignore]
    elif scheme == "int4":
        groups = [_group("group_0", [EXPERTS], 4, group_size)]
    else:
        raise ValueError(f"scheme: unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": dict(groups),
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def quantize_checkpoint(
    model_dir: str | Path, out_dir: str | Path, scheme: str = "int4-mixed", group_size: int = 32,
    ignore: list[str] | None = None, clip_search: bool = True, max_shard_bytes: int = 2 << 30,
    overwrite: bool = False, progress: bool = False,
) -> Path:
    """Write the quantized checkpoint of `model_dir` into `out_dir` (see the module docstring)."""
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tierlm.config import ModelConfig
    from tierlm.model.checkpoint_layout import checkpoint_layout, weight_module
    from tierlm.model.loader import attach_formats, check_layout, checkpoint_files, index_tensors, mtp_layout
    from tierlm.model.quantization.base import DENSE
    from tierlm.model.quantization.config import QuantizationConfig
    from tierlm.model.qwen4_exp import Qwen4ExpForCausalLM

    model_dir, out = Path(model_dir), Path(out_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    if raw.get("quantization_config"):
        raise ValueError(f"{model_dir} is already quantized (its config.json has a quantization_config)")
    config = ModelConfig.from_dict(raw)
    section = scheme_config(scheme, group_size, list(ignore or []))
    quantization = QuantizationConfig.from_config_json({"quantization_config": section})
    if out.resolve() == model_dir.resolve():
        raise ValueError("--out must differ from MODEL")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty")
    found = index_tensors(checkpoint_files(model_dir), with_mtp=True)
    mtp = mtp_layout(config, found)
    check_layout(config, found, None, mtp)
    checkpoint_layout(config, quantization, mtp=mtp)  # every quantized module's groups fit its width
    with torch.device("meta"):
        attach_formats(Qwen4ExpForCausalLM(config, mtp), quantization)  # packed modules agree on a format

    layout = checkpoint_layout(config, mtp=mtp)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # an overwritten checkpoint keeps no shard of the old one
    staging = Path(tempfile.mkdtemp(prefix=".quantize-", dir=out))
    shards: list[Path] = []
    weight_map: dict[str, int] = {}
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total_bytes = 0
    handles: dict[Path, Any] = {}

    def flush() -> None:
        nonlocal pending, pending_bytes
        if pending:
            path = staging / f"shard-{len(shards):05d}.safetensors"
            save_file(pending, str(path), metadata={"format": "pt"})
            for name in pending:
                weight_map[name] = len(shards)
            shards.append(path)
        pending, pending_bytes = {}, 0

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=Console(stderr=True), disable=not progress) as bar:
            task = bar.add_task(f"quantize {scheme}", total=len(layout))
            for spec in layout:
                file, name_in_file, _, _ = found[spec.name]
                if file not in handles:
                    handles[file] = safe_open(file, framework="pt")
                tensor = handles[file].get_tensor(name_in_file)
                module = weight_module(spec)
                fmt = quantization.format_of(*module) if module else DENSE
                if fmt == DENSE:
                    written = {name_in_file: tensor}
                else:
                    result = quantize_weight(tensor, fmt.bits, fmt.group_size, clip_search)
                    stem = name_in_file[: -len(".weight")]
                    written = {f"{stem}.{k}": v for k, v in fmt.pack(result.signed, result.scale).items()}
                for name, value in written.items():
                    pending[name] = value.contiguous()
                    pending_bytes += value.numel() * value.element_size()
                    total_bytes += value.numel() * value.element_size()
                if pending_bytes >= max_shard_bytes:
                    flush()
                bar.advance(task)
        flush()
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for path, name in zip(shards, names):
            path.replace(out / name)
        index = {"metadata": {"total_size": total_bytes},
                 "weight_map": {k: names[v] for k, v in sorted(weight_map.items())}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        for path in sorted(model_dir.iterdir()):  # tokenizer, generation config, chat template, ...
            if path.is_file() and path.suffix != ".safetensors" and path.name not in (
                "config.json", "model.safetensors.index.json"
            ):
                shutil.copy2(path, out / path.name)
        (out / "config.json").write_text(json.dumps({**raw, "quantization_config": section}, indent=2) + "\n")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "quantize",
        help="write a compressed-tensors INT4/INT6/INT8 checkpoint of a model",
        description="Quantize a checkpoint's weights (round-to-nearest with a per-group clip search) and write "
        "a compressed-tensors pack-quantized checkpoint that tierlm, vLLM and transformers read.",
    )
    parser.add_argument("model", metavar="MODEL", help="a local checkpoint folder (bf16 or fp32)")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="folder for the quantized checkpoint")
    parser.add_argument("--scheme", choices=SCHEMES, default="int4-mixed",
                        help="int4-mixed: INT4 experts, INT6 shared expert, INT8 embed/lm_head/hyper-connections; "
                        "int8: every linear but the router; int4: routed experts only")
    parser.add_argument("--group-size", type=int, default=32, help="inputs per scale of the INT4/INT6 weights")
    parser.add_argument("--ignore", action="append", default=[], metavar="PATTERN",
                        help="a module name or re:<regex> to keep unquantized (repeatable)")
    parser.add_argument("--no-clip-search", dest="clip_search", action="store_false",
                        help="plain round-to-nearest (scale = max|w| / qmax)")
    parser.add_argument("--max-shard-bytes", type=int, default=2 << 30, help="bytes per output safetensors file")
    parser.add_argument("--force", action="store_true", help="write into a non-empty DIR")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from tierlm.model.loader import CheckpointError, ModelNotFoundError, resolve_model_path

    if args.group_size <= 0:
        raise CliError(f"--group-size must be positive, got {args.group_size}")
    try:
        out = quantize_checkpoint(
            resolve_model_path(args.model), args.out, args.scheme, args.group_size, args.ignore,
            args.clip_search, args.max_shard_bytes, overwrite=args.force, progress=True,
        )
    except FileExistsError as exc:
        raise CliError(f"{exc}; pass --force to write into it") from None
    except (ValueError, CheckpointError, ModelNotFoundError) as exc:
        raise CliError(str(exc)) from None
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"wrote the {args.scheme} checkpoint to {out}: {size / 1e6:.1f} MB", file=sys.stderr)
    return 0
