"""Cold and warm TTFT with the PLE tables served from memory-mapped files, prefetch off vs on.

Builds (once) a demo model whose n-gram tables are several GB, exports them (`tierlm ple export`) into
the model folder (where the engine finds them), probes the drive (`tierlm probe-drive`), then for each
side (prefetch off, on) starts `tierlm serve`, drops the tables from the page cache and measures with
`tierlm bench` (client side) the TTFT of unseen prompts (cold lane: text no request sent before) of each
length, then the TTFT of a prompt whose pages are resident (warm), and prints both sides with ratios.

    python bench/ple_cold_ttft.py                                  # ~4 GB of tables, 4k/8k/16k prompts
    python bench/ple_cold_ttft.py --prompt-tokens 4096 --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_throughput import ROOT, server  # the shared server harness

# ~4 GB: 2 PLE layers x 16 heads x ~400k prime-sized rows x 80 fp32 values (320 B, the real row size)
TABLE_OVERRIDES = {"ngram_vocab_size_base": 400_000, "heads_per_ngram": 8, "ple_embed_dim": 1280}


def ensure_model(folder: Path) -> Path:
    from tierlm.demo_model import build_demo_model
    from tierlm.memory.ple_table import export_ple_tables

    if not (folder / "config.json").exists():
        build_demo_model(folder, "tiny", ple_overrides=TABLE_OVERRIDES, progress=True)
    if not (folder / "ple_tables" / "manifest.json").exists():
        export_ple_tables(folder, folder / "ple_tables")
    return folder


def evict(tables: Path) -> None:
    for file in tables.glob("*.bin"):
        fd = os.open(file, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def ttft_ms(base: str, model_dir: Path, prompt_tokens: int, lane: str, state: Path, requests: int = 1) -> float:
    """Median TTFT of `requests` sequential requests (cold lane: each with text never sent before)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        subprocess.run(
            [sys.executable, "-m", "tierlm.cli", "bench", "--base-url", base, "--model", model_dir.name,
             "--endpoint", "completions", "--concurrency", "1", "--num-requests", str(requests), "--warmup", "0",
             "--prompt-tokens", str(prompt_tokens), "--output-tokens", "2", "--lane", lane,
             "--state-file", str(state), "--tokenizer", str(model_dir / "tokenizer.json"), "--no-progress",
             "--result-json", result.name],
            check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
        )
        return json.loads(Path(result.name).read_text())["median_ttft_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=str(ROOT / "models" / "demo-ple-4g"))
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--probe-seconds", type=float, default=5)
    args = parser.parse_args()
    model_dir = ensure_model(Path(args.model_dir))
    tables = model_dir / "ple_tables"
    size = sum(f.stat().st_size for f in tables.glob("*.bin"))
    print(f"model {model_dir} with {size / 2**30:.2f} GiB of PLE tables in {tables}")
    probe = subprocess.run(
        [sys.executable, "-m", "tierlm.cli", "probe-drive", str(next(tables.glob("*.bin"))),
         "--seconds", str(args.probe_seconds), "--queue-depth", "32"],
        check=False, cwd=ROOT, capture_output=True, text=True,
    )
    print(probe.stdout.strip() or probe.stderr.strip())

    max_len = max(args.prompt_tokens) + 64
    state = Path(tempfile.mkdtemp()) / "bench_state.json"  # cold text is never reused across both sides
    results: dict[str, dict] = {}
    for side, flag in (("prefetch off", "--no-ple-prefetch"), ("prefetch on", "--ple-prefetch")):
        # prefix caching off: the warm measurement resends a prompt to find its pages resident, not cached
        extra = ["--max-model-len", str(max_len), "--max-num-batched-tokens", "2048", "--no-enable-prefix-caching", flag]
        with server(str(model_dir), args.device, extra) as base:
            ttft_ms(base, model_dir, 256, "warm", state)  # start-up costs out of the way
            side_results = {}
            for length in args.prompt_tokens:
                evict(tables)
                side_results[f"cold {length}"] = ttft_ms(base, model_dir, length, "cold", state)
            length = args.prompt_tokens[0]
            ttft_ms(base, model_dir, length, "warm", state)  # read its pages once
            side_results[f"warm {length}"] = ttft_ms(base, model_dir, length, "warm", state, requests=5)
            results[side] = side_results

    off, on = results["prefetch off"], results["prefetch on"]
    print(f"{'TTFT (ms)':<14}{'prefetch off':>14}{'prefetch on':>14}{'off / on':>10}")
    for key in off:
        print(f"{key:<14}{off[key]:>14.1f}{on[key]:>14.1f}{off[key] / on[key]:>9.2f}x")


if __name__ == "__main__":
    main()
