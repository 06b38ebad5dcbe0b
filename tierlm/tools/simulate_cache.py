"""`tierlm simulate-cache`: how many n-gram table reads would reach the drive, for a trace and cache sizes.

Before buying RAM or VRAM for the PLE table, replay real traffic: each input file is one request (text
tokenized with the model's tokenizer, or token ids), hashed to table rows with the numpy twin of the
model's hash (`tierlm.memory.ngram_rows_np`), per PLE layer, in forward order (each token reads its rows of
layer 0's table, then layer 1's ...). Three tiers are simulated, each on its own, at every size given:
- an LRU row cache (N rows, shared by all PLE layers);
- a static hot set of the N most frequent rows. The frequencies come from this same trace, so it is an
  oracle: the best any static set of N rows could do on it;
- the page cache: rows -> the 4 KiB pages of the `layer{L}.bin` files they lie in (a row may straddle
  two), LRU over N pages.
Requests run one after another and the caches stay warm across them. Each request's first (1 - F) of its
tokens count as prefill and the rest (F = --decode-fraction) as decode steps, one token each; the
figures are per phase: miss rate, misses (cold reads) per token, and for decode the share of steps that
read at least one row from the drive (a step that stalls on NVMe).

Speed: the LRU runs in O(accesses) with no dictionary. One sort of the trace links each access to the
previous and next access of the same key; an LRU of N keys then holds exactly the keys whose latest access
is one of the N most recent latest accesses, so it is described by one pointer (`lru_misses`) that only
moves forward. Measured on one core: 10 M tokens of the real model's shape (160 M row reads) take 28 s
for one LRU size and 105 s for six cache configurations (~80 ns per read and LRU size), and ~45 bytes
of RAM per row read (7 GB).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tierlm.cli import CliError

PAGE_BYTES = 4096
_CHUNK = 1 << 20  # accesses per Python list in the LRU loop
_HASH_CHUNK = 1 << 16  # tokens hashed per call


# ---- the access sequence --------------------------------------------------------------------------------


@dataclass(frozen=True)
class AccessTrace:
    """Keys read in order, grouped by token."""

    keys: np.ndarray  # int64, one per read
    token_starts: np.ndarray  # index of each token's first read (every token reads at least one key)
    is_decode: np.ndarray  # bool per token

    @classmethod
    def of_rows(cls, rows: np.ndarray, is_decode: np.ndarray) -> AccessTrace:
        """The row reads of `row_trace` [T, reads per token], token after token."""
        return cls(rows.ravel(), np.arange(len(rows), dtype=np.int64) * rows.shape[1], is_decode)


def phase_of_tokens(lengths: list[int], decode_fraction: float) -> np.ndarray:
    """Per token: True for decode (the last `decode_fraction` of each request's tokens)."""
    return np.concatenate(
        [np.arange(length) >= length - round(length * decode_fraction) for length in lengths]
    )


def row_trace(specs: list, requests: list[np.ndarray]) -> np.ndarray:
    """Rows read per token [T, layers x heads], keys made distinct across layers by each table's offset."""
    from tierlm.memory.ngram_rows_np import NgramHashArrays, carry_context, initial_context, ngram_rows_np

    hashes = [NgramHashArrays.from_spec(spec) for spec in specs]
    offsets = np.cumsum([0] + [spec.table_rows for spec in specs])[:-1]
    columns = np.cumsum([0] + [spec.num_heads for spec in specs])
    rows = np.empty((sum(len(ids) for ids in requests), columns[-1]), dtype=np.int64)
    token = 0
    for ids in requests:
        contexts = [initial_context(spec) for spec in specs]
        for begin in range(0, len(ids), _HASH_CHUNK):  # prefill-sized chunks: no huge temporaries
            chunk = ids[begin : begin + _HASH_CHUNK]
            out = rows[token : token + len(chunk)]
            for k, (h, offset) in enumerate(zip(hashes, offsets, strict=True)):
                out[:, columns[k] : columns[k + 1]] = ngram_rows_np(h, contexts[k], chunk) + offset
                contexts[k] = carry_context(contexts[k], chunk)
            token += len(chunk)
    return rows


def page_trace(rows: np.ndarray, specs: list, row_bytes: int, is_decode: np.ndarray) -> AccessTrace:
    """The 4 KiB file pages the row reads touch (first page, then the second when a row straddles two)."""
    if row_bytes > PAGE_BYTES:
        raise ValueError(f"row_bytes {row_bytes} is larger than a page ({PAGE_BYTES} B); not simulated")
    heads = [spec.num_heads for spec in specs]
    table_pages = [-(-spec.table_rows * row_bytes // PAGE_BYTES) for spec in specs]
    row_offset = np.repeat(np.cumsum([0] + [s.table_rows for s in specs])[:-1], heads)
    page_offset = np.repeat(np.cumsum([0] + table_pages)[:-1], heads)
    first = (rows - row_offset) * row_bytes  # byte offset in the layer's file, then its page
    last = first + (row_bytes - 1)
    first //= PAGE_BYTES
    last //= PAGE_BYTES
    straddles = last != first
    first += page_offset
    last += page_offset
    reads = straddles.ravel().astype(np.int64) + 1
    keys = np.repeat(first.ravel(), reads)
    del first
    keys[(np.cumsum(reads) - 1)[straddles.ravel()]] = last[straddles]
    per_token = rows.shape[1] + straddles.sum(axis=1)
    token_starts = np.concatenate([[0], np.cumsum(per_token)[:-1]])
    return AccessTrace(keys, token_starts, is_decode)


# ---- reuse links and the simulated caches ---------------------------------------------------------------


@dataclass(frozen=True)
class Reuse:
    """The access sequence grouped by key, from one sort: what the LRU and the hot set both need."""

    prev: np.ndarray  # index of the previous access of the same key, -1 for a first access
    next: np.ndarray  # index of the next access of the same key, len(keys) for a last access
    group: np.ndarray  # per access: its key's index among the distinct keys (ascending key order)
    counts: np.ndarray  # accesses per distinct key

    @classmethod
    def of(cls, keys: np.ndarray) -> Reuse:
        n = len(keys)
        index_type = np.int32 if n < 2**31 - 1 else np.int64
        shift = max(n, 1).bit_length()
        if n and keys.max() < (1 << (63 - shift)):
            # (key, position) packed into one int64: a plain in-place sort (SIMD) is then a stable sort
            packed = keys.astype(np.int64)
            packed <<= shift
            for begin in range(0, n, _CHUNK):
                packed[begin : begin + _CHUNK] |= np.arange(begin, min(begin + _CHUNK, n), dtype=np.int64)
            packed.sort()
            order = np.empty(n, dtype=index_type)
            np.bitwise_and(packed, (1 << shift) - 1, out=order, casting="unsafe")
            packed >>= shift
            new_key = np.empty(n, dtype=bool)
            new_key[0] = True
            np.not_equal(packed[1:], packed[:-1], out=new_key[1:])
            del packed
        else:
            order = np.argsort(keys, kind="stable").astype(index_type)
            new_key = np.ones(n, dtype=bool)
            np.not_equal(keys[order[1:]], keys[order[:-1]], out=new_key[1:])
        # each array is built in sorted order in `scratch`, then scattered to access order
        scratch = np.empty(n, dtype=index_type)
        prev, nxt, group = (np.empty(n, dtype=index_type) for _ in range(3))
        scratch[:1] = -1
        scratch[1:] = order[:-1]
        scratch[new_key] = -1
        prev[order] = scratch
        scratch[:-1] = order[1:]
        scratch[-1:] = n
        scratch[:-1][new_key[1:]] = n
        nxt[order] = scratch
        np.cumsum(new_key, dtype=index_type, out=scratch)
        scratch -= 1
        group[order] = scratch
        counts = np.diff(np.append(np.flatnonzero(new_key), n))
        return cls(prev, nxt, group, counts)


def lru_misses(reuse: Reuse, capacity: int) -> np.ndarray:
    """Which accesses miss an LRU cache of `capacity` keys (bool per access).

    Before access i the cache holds the keys whose latest access lies in [theta, i): LRU order is the order
    of latest accesses, and a key's latest access lies inside the window until the key is evicted. So
    access i hits iff its previous access is >= theta; a miss (when full) evicts the least recently used
    key: theta moves past accesses that are no longer their key's latest (next access < i), then past
    that key's latest access. theta only moves forward: O(accesses) in all.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be at least 1, got {capacity}")
    n = len(reuse.prev)
    later = memoryview(reuse.next)
    theta, held = 0, 0
    missed = np.zeros(n, dtype=bool)
    for begin in range(0, n, _CHUNK):
        flags = bytearray(min(_CHUNK, n - begin))
        i = begin - 1
        for p in reuse.prev[begin : begin + _CHUNK].tolist():
            i += 1
            if p >= theta:
                continue
            flags[i - begin] = 1
            if held < capacity:
                held += 1
                continue
            while later[theta] < i:
                theta += 1
            theta += 1
        missed[begin : begin + len(flags)] = np.frombuffer(flags, dtype=bool)
    return missed


def hot_set_misses(reuse: Reuse, capacity: int) -> np.ndarray:
    """Which accesses miss a static set of the `capacity` most frequent keys (ties: the smaller key)."""
    keys = len(reuse.counts)
    hot = np.ones(keys, dtype=bool)
    if capacity < keys:
        # distinct ranks, smallest = hottest: (fewer accesses, larger key) ranks later
        rank = (int(reuse.counts.max()) - reuse.counts) * keys + np.arange(keys)
        hot[:] = False
        hot[np.argpartition(rank, capacity - 1)[:capacity]] = True
    return ~hot[reuse.group]


# ---- figures ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PhaseFigures:
    tokens: int
    reads: int
    misses: int
    steps_with_miss: int

    @property
    def miss_rate(self) -> float:
        return self.misses / self.reads if self.reads else 0.0

    @property
    def misses_per_token(self) -> float:
        return self.misses / self.tokens if self.tokens else 0.0

    @property
    def share_of_steps_with_miss(self) -> float:
        return self.steps_with_miss / self.tokens if self.tokens else 0.0


def phase_figures(trace: AccessTrace, missed: np.ndarray) -> dict[str, PhaseFigures]:
    """Misses split into prefill and decode, per read and per token."""
    reads = np.diff(np.append(trace.token_starts, len(trace.keys)))
    # summed as bytes when a token's reads fit one (no wide copy of the whole trace)
    wide = np.int64 if reads.max() > 255 else np.uint8
    per_token = np.add.reduceat(missed.view(np.uint8), trace.token_starts, dtype=wide).astype(np.int64)
    figures = {}
    for name, mask in (("prefill", ~trace.is_decode), ("decode", trace.is_decode)):
        figures[name] = PhaseFigures(
            tokens=int(mask.sum()),
            reads=int(reads[mask].sum()),
            misses=int(per_token[mask].sum()),
            steps_with_miss=int((per_token[mask] > 0).sum()),
        )
    return figures


# ---- command line -----------------------------------------------------------------------------------------


def read_requests(
    model_dir: Path, texts: list[Path] | None, token_ids: list[Path] | None
) -> list[np.ndarray]:
    """One int64 id array per input file."""
    requests = []
    if texts:
        from tierlm.tokenizer import Tokenizer, TokenizerError

        try:
            tokenizer = Tokenizer.from_pretrained(model_dir)
        except TokenizerError as exc:
            raise CliError(f"--text needs the model's tokenizer: {exc}") from None
    for path in texts or token_ids or []:
        try:
            if texts:
                ids = tokenizer.encode(
                    path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False
                )
                requests.append(np.asarray(ids, dtype=np.int64))
            elif path.suffix == ".npy":
                requests.append(np.load(path).astype(np.int64).ravel())
            else:
                requests.append(np.array(path.read_text().split(), dtype=np.int64))
        except OSError as exc:
            raise CliError(f"cannot read {path}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise CliError(f"{path}: not token ids (whitespace-separated integers or .npy): {exc}") from None
        if (requests[-1] < 0).any():
            raise CliError(f"{path}: negative token ids")
    return requests


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "simulate-cache",
        help="replay a token trace against row-cache, hot-set and page-cache sizes for the n-gram table",
        description=__doc__.split("\n\n")[1],
        epilog="Example: tierlm simulate-cache --model MODEL --token-ids trace/*.npy --row-cache-rows "
        "1000000 "
        "4000000 --hot-set-rows 1000000 --page-cache-pages 262144 1048576",
    )
    parser.add_argument(
        "--model", required=True, help="checkpoint folder (config.json; tokenizer for --text)"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", nargs="+", type=Path, metavar="FILE", help="text files, one request each")
    source.add_argument(
        "--token-ids",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="token-id files (whitespace-separated ints, or .npy), one request each",
    )
    parser.add_argument(
        "--row-cache-rows", nargs="+", type=int, default=[], metavar="N", help="LRU row caches"
    )
    parser.add_argument(
        "--hot-set-rows",
        nargs="+",
        type=int,
        default=[],
        metavar="N",
        help="static sets of the N most frequent rows of this trace (an oracle)",
    )
    parser.add_argument(
        "--page-cache-pages",
        nargs="+",
        type=int,
        default=[],
        metavar="N",
        help="LRU page caches of N 4 KiB pages of the table files",
    )
    parser.add_argument(
        "--decode-fraction",
        type=float,
        default=0.25,
        metavar="F",
        help="the last F of each request's tokens are decode steps (default 0.25)",
    )
    parser.add_argument(
        "--row-bytes",
        type=int,
        default=None,
        help="bytes per table row (default: from config.json's dtype and the PLE row width)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tierlm.config import ConfigError, ModelConfig
    from tierlm.memory.ple_table import ITEM_BYTES
    from tierlm.model.loader import ModelNotFoundError, resolve_model_path
    from tierlm.model.ngram_hash import NgramHashSpec

    sizes = {"row": args.row_cache_rows, "hot": args.hot_set_rows, "page": args.page_cache_pages}
    if not any(sizes.values()):
        raise CliError("give at least one size: --row-cache-rows, --hot-set-rows or --page-cache-pages")
    bad = [n for values in sizes.values() for n in values if n < 1]
    if bad:
        raise CliError(f"cache sizes must be positive, got {bad[0]}")
    if not 0 <= args.decode_fraction <= 1:
        raise CliError(f"--decode-fraction {args.decode_fraction:g} must lie in [0, 1]")
    try:
        model_dir = resolve_model_path(args.model)
        config = ModelConfig.from_pretrained(model_dir)
    except (ConfigError, ModelNotFoundError) as exc:
        raise CliError(str(exc)) from None
    if not config.ple_layer_ids:
        raise CliError(f"{args.model}: the model has no PLE layers")
    row_bytes = args.row_bytes
    if row_bytes is None:
        if config.torch_dtype not in ITEM_BYTES:
            raise CliError(
                f"config.json's dtype {config.torch_dtype!r}: pass --row-bytes (bytes per table row)"
            )
        row_bytes = config.ngram_head_dim * ITEM_BYTES[config.torch_dtype]
    if not 0 < row_bytes <= PAGE_BYTES:
        raise CliError(
            f"--row-bytes {row_bytes} must lie in [1, {PAGE_BYTES}] (a row within at most two pages)"
        )

    start = time.perf_counter()
    requests = read_requests(model_dir, args.text, args.token_ids)
    lengths = [len(ids) for ids in requests]
    if not sum(lengths):
        raise CliError("the trace has no tokens")
    specs = [NgramHashSpec.from_config(config, k) for k in range(len(config.ple_layer_ids))]
    is_decode = phase_of_tokens(lengths, args.decode_fraction)
    rows = row_trace(specs, requests)
    row_reads = AccessTrace.of_rows(rows, is_decode)
    prepared = time.perf_counter()

    results = []
    reuse = Reuse.of(row_reads.keys)
    distinct_rows = len(reuse.counts)
    for n in sizes["row"]:
        results.append(("LRU row cache", n, n * row_bytes, phase_figures(row_reads, lru_misses(reuse, n))))
    for n in sizes["hot"]:
        results.append(
            ("hot set (oracle)", n, n * row_bytes, phase_figures(row_reads, hot_set_misses(reuse, n)))
        )
    del reuse
    distinct_pages = None
    if sizes["page"]:
        pages = page_trace(rows, specs, row_bytes, is_decode)
        reuse = Reuse.of(pages.keys)
        distinct_pages = len(reuse.counts)
        for n in sizes["page"]:
            results.append(("page cache", n, n * PAGE_BYTES, phase_figures(pages, lru_misses(reuse, n))))
    seconds = time.perf_counter() - start

    report = {
        "requests": len(requests),
        "tokens": len(is_decode),
        "decode_tokens": int(is_decode.sum()),
        "decode_fraction": args.decode_fraction,
        "ple_layers": len(specs),
        "row_reads_per_token": rows.shape[1],
        "row_bytes": row_bytes,
        "distinct_rows": distinct_rows,
        "distinct_pages": distinct_pages,
        "results": [
            {
                "cache": name,
                "size": n,
                "bytes": nbytes,
                **{
                    phase: {
                        **asdict(f),
                        "miss_rate": f.miss_rate,
                        "misses_per_token": f.misses_per_token,
                        "share_of_steps_with_miss": f.share_of_steps_with_miss,
                    }
                    for phase, f in fig.items()
                },
            }
            for name, n, nbytes, fig in results
        ],
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    sys.stdout.flush()
    print(
        f"simulated {len(row_reads.keys):,} row reads in {seconds:.1f} s (reading and hashing the trace "
        f"{prepared - start:.1f} s)",
        file=sys.stderr,
    )
    return 0


def _print_table(report: dict) -> None:
    tokens, decode = report["tokens"], report["decode_tokens"]
    pages = report["distinct_pages"]
    print(
        f"trace: {report['requests']} requests, {tokens:,} tokens: {tokens - decode:,} prefill, "
        f"{decode:,} decode "
        f"(the last {report['decode_fraction']:g} of each request)"
    )
    print(
        f"PLE: {report['ple_layers']} layer(s), {report['row_reads_per_token']} row reads per token, "
        f"{report['row_bytes']} B rows; {report['distinct_rows']:,} distinct rows"
        + (f", {pages:,} distinct 4 KiB pages" if pages is not None else "")
    )
    print(
        "caches are shared by all PLE layers and stay warm across requests; the hot set is the trace's own "
        "most frequent rows"
    )
    header = (
        f"{'cache':<17}{'size':>12}{'bytes':>10} | {'prefill miss':>12}{'misses/tok':>11} | "
        f"{'decode miss':>11}{'misses/tok':>11}{'steps w/ drive read':>21}"
    )
    print(header)
    print("-" * len(header))
    for r in report["results"]:
        pre, dec = r["prefill"], r["decode"]
        print(
            f"{r['cache']:<17}{r['size']:>12,}{_human(r['bytes']):>10} | "
            f"{pre['miss_rate']:>12.2%}{pre['misses_per_token']:>11.2f} | "
            f"{dec['miss_rate']:>11.2%}{dec['misses_per_token']:>11.2f}{dec['share_of_steps_with_miss']:>21.2%}"
        )


def _human(nbytes: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
