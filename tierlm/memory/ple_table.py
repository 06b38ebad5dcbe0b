"""PLE n-gram tables as flat files on NVMe: the export from a checkpoint, and the manifest describing them.

The real model's n-gram table is 95 GiB (320 M rows x 320 B); the engine serves it from a memory-mapped
file, where row r lies at byte r * row_bytes. A checkpoint stores each table split into
`...ngram_embedding.shard_{j}.weight` parts; `export_ple_tables` concatenates them, in integer order j,
into one row-major `layer{L}.bin` per PLE layer (L: the 0-based decoder layer), the checkpoint's dtype byte
for byte, streaming bounded pieces so no table is ever held in RAM, and writes `manifest.json` last: its
presence means every file is complete. `load_manifest` checks a folder against the model config (the hash
constants recomputed, rows, row width, file sizes) before the engine maps anything.
A float8 e4m3 table (vLLM's fp8 PLE checkpoint: fp8 shards and one `ngram_embedding.weight_scale`) is
written as is, and its scale recorded in the manifest (embedding = stored row * scale); `fp8=True`
converts a bf16/fp32 table to one.
It owns the file format; the mmap row source, prefetch and page-cache advice live with the engine.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from tierlm.config import ModelConfig
from tierlm.model.checkpoint_layout import ple_shard_rows
from tierlm.model.loader import checkpoint_files
from tierlm.model.ngram_hash import NgramHashSpec

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PIECE_BYTES = 64 << 20  # rows read from a shard and written per step
FP8, FP8_MAX = "float8_e4m3fn", 448.0

# safetensors dtype tag -> (name in the manifest, bytes per value)
DTYPES = {
    "F32": ("float32", 4),
    "BF16": ("bfloat16", 2),
    "F16": ("float16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}
ITEM_BYTES = dict(DTYPES.values())

_SHARD = re.compile(
    r"(?:model\.language_model\.|model\.)layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\.weight"
)
_SCALE = re.compile(
    r"(?:model\.language_model\.|model\.)layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding\.weight_scale"
)


class PleTableError(ValueError):
    """A table folder or checkpoint that does not fit the model config; the message names what differs."""

    def __init__(self, where: str, layer: int | None, field: str, expected: Any, found: Any) -> None:
        self.layer, self.field, self.expected, self.found = layer, field, expected, found
        at = f"layer {layer}, " if layer is not None else ""
        super().__init__(f"{where}: {at}{field}: expected {expected}, found {found}")


@dataclass(frozen=True)
class PleLayerTable:
    """One PLE layer's table file and the hash that indexes it (the manifest's entry for the layer)."""

    layer: int  # 0-based decoder layer
    ple_index: int
    file: str  # name inside the table folder
    rows: int
    row_bytes: int
    dtype: str
    num_heads: int
    heads_per_ngram: int
    ngram_size: int
    head_vocab_sizes: list[int]
    head_offsets: list[int]
    multipliers: list[int]
    seed: int
    eos: int
    scale: float | None = None  # float8 tables: the global scale (row values are stored / scale)

    @classmethod
    def expected(cls, config: ModelConfig, ple_index: int, dtype: str) -> PleLayerTable:
        """The entry the config implies for PLE layer `ple_index` stored in `dtype`."""
        spec = NgramHashSpec.from_config(config, ple_index)
        layer = config.ple_layer_ids[ple_index] - 1
        return cls(
            layer=layer,
            ple_index=ple_index,
            file=f"layer{layer}.bin",
            rows=spec.table_rows,
            row_bytes=config.ngram_head_dim * ITEM_BYTES[dtype],
            dtype=dtype,
            num_heads=spec.num_heads,
            heads_per_ngram=spec.heads_per_ngram,
            ngram_size=spec.ngram_size,
            head_vocab_sizes=list(spec.head_sizes),
            head_offsets=list(spec.head_offsets),
            multipliers=list(spec.multipliers),
            seed=config.seed,
            eos=spec.eos_token_id,
        )

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass(frozen=True)
class PleTableManifest:
    """A checked table folder: where each PLE layer's file is and how to index it."""

    directory: Path
    layers: tuple[PleLayerTable, ...]

    def path(self, table: PleLayerTable) -> Path:
        return self.directory / table.file


# ---- export ---------------------------------------------------------------------------------------------


def _find_shards(model_dir: Path) -> tuple[dict[int, dict[int, tuple[Path, str]]], dict[int, float]]:
    """decoder layer -> shard j -> (file, tensor name), from the files' headers; and decoder layer -> the
    global scale of an fp8 table (`ngram_embedding.weight_scale`)."""
    from safetensors import safe_open

    found: dict[int, dict[int, tuple[Path, str]]] = {}
    scales: dict[int, float] = {}
    for file in checkpoint_files(model_dir):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if m := _SHARD.fullmatch(name):
                    found.setdefault(int(m.group(1)), {})[int(m.group(2))] = (file, name)
                elif m := _SCALE.fullmatch(name):
                    scales[int(m.group(1))] = float(f.get_tensor(name).reshape(-1)[0])
    return found, scales


def _plan_layer(config: ModelConfig, ple_index: int, shards: dict[int, tuple[Path, str]], where: str):
    """The expected entry of one layer and its shards in order, checked (count, rows, width, dtype)."""
    from safetensors import safe_open

    spec = NgramHashSpec.from_config(config, ple_index)
    layer = config.ple_layer_ids[ple_index] - 1
    sizes = ple_shard_rows(spec.table_rows, config.split_ngram_parts)
    if sorted(shards) != list(range(len(sizes))):
        raise PleTableError(
            where,
            layer,
            "table shards",
            f"shard_0 .. shard_{len(sizes) - 1}",
            ", ".join(f"shard_{j}" for j in sorted(shards)) or "none",
        )
    ordered, dtype_tags = [], set()
    for j, rows in enumerate(sizes):
        file, name = shards[j]
        with safe_open(file, framework="pt") as f:
            view = f.get_slice(name)
            shape, tag = tuple(view.get_shape()), view.get_dtype()
        if shape != (rows, config.ngram_head_dim):
            raise PleTableError(where, layer, f"shape of {name}", [rows, config.ngram_head_dim], list(shape))
        if tag not in DTYPES:
            raise PleTableError(where, layer, f"dtype of {name}", " or ".join(DTYPES), tag)
        dtype_tags.add(tag)
        ordered.append((file, name, rows))
    if len(dtype_tags) > 1:
        raise PleTableError(where, layer, "shard dtypes", "one dtype", sorted(dtype_tags))
    return PleLayerTable.expected(config, ple_index, DTYPES[dtype_tags.pop()][0]), ordered


def _fp8_scale(ordered: list[tuple[Path, str, int]], row_bytes: int) -> float:
    """max |value| / 448 (the largest e4m3 value) over a table's shards, read in bounded pieces."""
    import torch
    from safetensors import safe_open

    amax, step = 0.0, max(1, PIECE_BYTES // row_bytes)
    for file, name, rows in ordered:
        with safe_open(file, framework="pt") as f:
            view = f.get_slice(name)
            for start in range(0, rows, step):
                amax = max(amax, view[start : min(start + step, rows)].abs().max().item())
    return float(torch.tensor((amax or 1.0) / FP8_MAX, dtype=torch.float32))  # as a checkpoint stores it


def export_ple_tables(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    on_bytes: Callable[[int, int], None] | None = None,
    fp8: bool = False,
) -> PleTableManifest:
    """Write every PLE layer's table of the checkpoint in `model_dir` as `out_dir/layer{L}.bin` + manifest.

    A non-empty `out_dir` is refused unless `overwrite` (then only the manifest and table files are
    replaced). Each file is written as `.partial`, fsynced, dropped from the page cache (benchmarks and the
    engine then start from a cold table, as after a reboot) and renamed; the manifest comes last.
    `on_bytes(done, total)` reports progress. fp8: write a bf16/fp32 table as float8 e4m3 with one global
    scale (max |value| / 448, found in a first streaming pass), half the bytes of bf16.
    """
    import torch
    from safetensors import safe_open

    model_dir, out = Path(model_dir), Path(out_dir)
    config = ModelConfig.from_pretrained(model_dir)
    if not config.ple_layer_ids:
        raise ValueError(f"{model_dir}: the model has no PLE layers (ple_layer_ids is empty)")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty")
    shards, scales = _find_shards(model_dir)
    where = f"checkpoint {model_dir}"
    plans = []
    for k, layer_id in enumerate(config.ple_layer_ids):
        table, ordered = _plan_layer(config, k, shards.get(layer_id - 1, {}), where)
        if table.dtype == "float8_e4m3fn":
            if layer_id - 1 not in scales:
                raise PleTableError(
                    where, layer_id - 1, "ngram_embedding.weight_scale", "the fp8 table's scale", "none"
                )
            table = replace(table, scale=scales[layer_id - 1])
        elif fp8:
            table = replace(PleLayerTable.expected(config, k, FP8), scale=_fp8_scale(ordered, table.row_bytes))
        plans.append((table, ordered))
    total = sum(table.nbytes for table, _ in plans)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [MANIFEST] + [name for t, _ in plans for name in (t.file, f"{t.file}.partial")]:
        (out / stale).unlink(missing_ok=True)  # manifest first: the folder is invalid from here on
    free = shutil.disk_usage(out).free
    if free < total:
        raise OSError(
            errno.ENOSPC, f"{out}: the tables need {total / 1e9:.2f} GB, {free / 1e9:.2f} GB are free"
        )

    done = 0
    for table, ordered in plans:
        partial = out / f"{table.file}.partial"
        step = max(1, PIECE_BYTES // table.row_bytes)
        with open(partial, "wb") as sink:
            for file, name, rows in ordered:
                with safe_open(file, framework="pt") as f:
                    view = f.get_slice(name)
                    for start in range(0, rows, step):
                        piece = view[start : min(start + step, rows)]
                        if table.scale is not None and piece.dtype != torch.float8_e4m3fn:
                            piece = (piece.float() / table.scale).to(torch.float8_e4m3fn)
                        piece = piece.reshape(-1).view(torch.uint8)
                        sink.write(memoryview(piece.numpy()))
                        done += piece.numel()
                        if on_bytes:
                            on_bytes(done, total)
            sink.flush()
            os.fsync(sink.fileno())
            os.posix_fadvise(sink.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        partial.replace(out / table.file)
    manifest = {"format_version": FORMAT_VERSION, "layers": [asdict(table) for table, _ in plans]}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return PleTableManifest(out, tuple(table for table, _ in plans))


# ---- load and check -------------------------------------------------------------------------------------


def load_manifest(directory: str | Path, config: ModelConfig) -> PleTableManifest:
    """Read `directory/manifest.json` and check it against `config` and the files; `PleTableError` if not."""
    directory = Path(directory)
    where = f"PLE tables {directory}"
    try:
        raw = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        raise PleTableError(
            where, None, MANIFEST, "a manifest written by `tierlm ple export`", "no file"
        ) from None
    except json.JSONDecodeError as exc:
        raise PleTableError(where, None, MANIFEST, "valid JSON", str(exc)) from None
    if raw.get("format_version") != FORMAT_VERSION:
        raise PleTableError(where, None, "format_version", FORMAT_VERSION, raw.get("format_version"))
    entries = raw.get("layers", [])
    expected_layers = [layer_id - 1 for layer_id in config.ple_layer_ids]
    found_layers = [entry.get("layer") for entry in entries]
    if found_layers != expected_layers:
        raise PleTableError(where, None, "PLE layers", expected_layers, found_layers)
    names = [f.name for f in fields(PleLayerTable) if f.name != "scale"]  # the scale: fp8 tables only
    tables = []
    for ple_index, (layer, entry) in enumerate(zip(expected_layers, entries, strict=True)):
        if sorted(set(entry) - {"scale"}) != sorted(names):
            raise PleTableError(where, layer, "fields", sorted(names), sorted(entry))
        if entry["dtype"] not in ITEM_BYTES:
            raise PleTableError(where, layer, "dtype", " or ".join(ITEM_BYTES), entry["dtype"])
        if (entry["dtype"] == "float8_e4m3fn") != (entry.get("scale") is not None):
            raise PleTableError(where, layer, "scale", "a scale for float8_e4m3fn tables only", entry.get("scale"))
        expected = asdict(PleLayerTable.expected(config, ple_index, entry["dtype"]))
        for name in names:
            if entry[name] != expected[name]:
                raise PleTableError(where, layer, name, expected[name], entry[name])
        table = PleLayerTable(**entry)
        path = directory / table.file
        size = path.stat().st_size if path.is_file() else None
        if size != table.nbytes:
            found = "no file" if size is None else f"{size} bytes"
            raise PleTableError(where, layer, f"size of {table.file}", f"{table.nbytes} bytes", found)
        tables.append(table)
    return PleTableManifest(directory, tuple(tables))
