"""`tierlm ple export MODEL --out DIR`: a checkpoint's PLE n-gram tables as flat, memory-mappable files.

The command line of `tierlm.memory.ple_table.export_ple_tables` (which owns the format): argument checks,
a byte progress bar and a summary. Further `tierlm ple ...` actions would register beside `export`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tierlm.cli import CliError


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("ple", help="PLE n-gram table files (export for NVMe serving)")
    actions = parser.add_subparsers(dest="ple_command", metavar="ACTION", required=True)
    export = actions.add_parser(
        "export",
        help="write each PLE layer's table as one flat row-major file + manifest.json",
        description="Concatenate each PLE layer's checkpoint shards into DIR/layer{L}.bin (rows x row bytes, "
        "the checkpoint's dtype) and write DIR/manifest.json with the hash constants the engine checks.",
    )
    export.add_argument("model", help="a local checkpoint folder")
    export.add_argument("--out", required=True, type=Path, metavar="DIR", help="folder for the table files")
    export.add_argument(
        "--force", action="store_true", help="write into a non-empty DIR (replacing the tables)"
    )
    export.add_argument(
        "--fp8", action="store_true",
        help="write bf16/fp32 tables as float8 e4m3 with one global scale each (half the bytes of bf16)",
    )
    export.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from tierlm.memory.ple_table import export_ple_tables
    from tierlm.model.loader import resolve_model_path

    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise CliError(f"--out {out} is not empty; pass --force to write the tables into it anyway")
    start = time.perf_counter()
    console = Console(stderr=True)
    columns = (BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    try:
        model_dir = resolve_model_path(args.model)
        with Progress(*columns, console=console) as bar:
            task = bar.add_task("export", total=None)
            manifest = export_ple_tables(
                model_dir,
                out,
                overwrite=args.force,
                on_bytes=lambda done, total: bar.update(task, completed=done, total=total),
                fp8=args.fp8,
            )
    except (ValueError, OSError) as exc:  # ConfigError, PleTableError, ModelNotFoundError, no space
        raise CliError(str(exc)) from None
    seconds = time.perf_counter() - start
    for table in manifest.layers:
        print(
            f"layer {table.layer} (PLE {table.ple_index}): {manifest.path(table)}  {table.rows:,} rows x "
            f"{table.row_bytes} B {table.dtype} = {table.nbytes / 2**30:.2f} GiB"
        )
    total = sum(table.nbytes for table in manifest.layers)
    print(
        f"wrote {total / 1e9:.2f} GB in {seconds:.1f} s ({total / 1e6 / max(seconds, 1e-9):.0f} MB/s)",
        file=sys.stderr,
    )
    return 0
