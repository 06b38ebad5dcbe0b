"""The PLE tables as memory-mapped files: same outputs as in memory, prefetch at admission (process_madvise
and its per-range fallback), decode-time advice, cancellation."""

from __future__ import annotations

import json
import mmap
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from tierlm import LLM, SamplingParams
from tierlm.config import ModelConfig
from tierlm.demo_model import build_demo_model, demo_config
from tierlm.memory.madvise import PAGE_SIZE, resident_pages, row_pages
from tierlm.memory.ngram_prefetch import PrefetchWorker
from tierlm.memory.ngram_store import NgramStore
from tierlm.memory.ple_table import FORMAT_VERSION, MANIFEST, PleLayerTable, export_ple_tables

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def model_with_tables(tmp_path_factory):
    """The tiny demo model with a table big enough (tens of MB) that a prompt touches a small share of it."""
    folder = tmp_path_factory.mktemp("ple")
    model = build_demo_model(folder / "model", "tiny", ple_overrides={"ngram_vocab_size_base": 200_000})
    export_ple_tables(model, folder / "tables")
    return model, folder / "tables"


def evict(tables) -> None:
    for name in os.listdir(tables):
        if name.endswith(".bin"):
            fd = os.open(tables / name, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def expected_pages(store: NgramStore, tokens: list[int]) -> list[set[int]]:
    rows = store.rows_for(store.context_of([]), np.asarray(tokens))
    return [set(row_pages(r.reshape(-1) * t.row_bytes, t.row_bytes).tolist()) for t, r in zip(store.tables, rows)]


def resident(store: NgramStore) -> list[set[int]]:
    return [set(np.flatnonzero(resident_pages(t.address, t.length)).tolist()) for t in store.tables]


def wait_resident(store: NgramStore, wanted: list[set[int]], timeout: float = 10.0) -> list[set[int]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = resident(store)
        if all(w <= n for w, n in zip(wanted, now)):
            return now
        time.sleep(0.02)
    return resident(store)


def test_mapped_tables_give_the_in_memory_outputs(model_with_tables):
    model, tables = model_with_tables
    in_memory = LLM(str(model), device="cpu", max_model_len=512)
    prompts = ["def handler(event, context):\n    return", "import numpy as np\n" * 5]
    expected = in_memory.generate(prompts, PARAMS)
    for prefetch in (True, False):
        mapped = LLM(str(model), device="cpu", max_model_len=512, ple_table=str(tables), ple_prefetch=prefetch)
        assert all(layer.ple is None or layer.ple.table is None for layer in mapped.engine.model.model.layers)
        got = mapped.generate(prompts, PARAMS)
        for a, b in zip(got, expected):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert [list(p.items()) for p in a.outputs[0].logprobs] == [list(p.items()) for p in b.outputs[0].logprobs]
        stats = mapped.engine.stats()
        assert stats.ple_rows_gathered > 0 and stats.ple_pages_advised > 0  # decode-time advice in both
        if prefetch:  # every admitted prompt was handed over; what a finished request left is dropped
            worker = mapped.engine.prefetcher
            assert worker.wait_idle()
            assert worker.submitted_tokens >= sum(len(o.prompt_token_ids) for o in got)
            assert worker.advised_tokens + worker.dropped_tokens == worker.submitted_tokens
        else:
            assert mapped.engine.prefetcher is None


@pytest.mark.parametrize("fallback", [False, True])
def test_admission_prefetch_makes_the_prompt_pages_resident(model_with_tables, fallback):
    model, tables = model_with_tables
    config = ModelConfig.from_pretrained(model)
    store = NgramStore(str(tables), config, torch.device("cpu"), force_madvise_fallback=fallback)
    worker = PrefetchWorker(store)
    tokens = np.random.default_rng(0).integers(3, config.vocab_size, 3000).tolist()
    wanted = expected_pages(store, tokens)
    evict(tables)
    before = resident(store)
    assert sum(len(w & b) for w, b in zip(wanted, before)) < sum(len(w) for w in wanted) // 10
    worker.submit("request-1", tokens, 0)
    assert worker.wait_idle()
    after = wait_resident(store, wanted)
    # every page the prompt's gathers will touch is advised before any forward ran (exact); the kernel
    # reads ahead on that advice best-effort (WILLNEED readahead may be cut short while other processes
    # load the machine: once in a full suite run, a few pages were missing after 10 s), so residency is
    # checked as most of them, against under a tenth before
    assert store.counters.pages_advised >= sum(len(w) for w in wanted)
    assert sum(len(w & n) for w, n in zip(wanted, after)) >= 0.9 * sum(len(w) for w in wanted)
    assert store.advisor.use_process_madvise is not fallback
    worker.stop()


def test_cancelled_prefetch_stops(model_with_tables):
    model, tables = model_with_tables
    config = ModelConfig.from_pretrained(model)
    store = NgramStore(str(tables), config, torch.device("cpu"))
    worker = PrefetchWorker(store)
    tokens = np.random.default_rng(1).integers(3, config.vocab_size, 200_000).tolist()
    worker.submit("long", tokens, 0)
    worker.cancel("long")
    assert worker.wait_idle()
    assert worker.advised_tokens < len(tokens)
    assert worker.advised_tokens + worker.dropped_tokens == len(tokens)
    assert worker.backlog_tokens == 0
    worker.stop()


def test_decode_advice_covers_exactly_the_new_tokens_rows(model_with_tables):
    model, tables = model_with_tables
    config = ModelConfig.from_pretrained(model)
    store = NgramStore(str(tables), config, torch.device("cpu"))
    context, token = store.context_of([17, 42]), np.asarray([1234])
    rows = store.rows_for(context, token)
    calls = []
    store.advisor.advise = lambda starts, lengths: calls.append((starts.copy(), lengths.copy()))
    store.advise_rows(rows, merge=False)
    assert len(calls) == 1  # one call for all layers' rows
    starts, lengths = calls[0]
    assert (lengths == PAGE_SIZE).all()
    advised = sorted(starts.tolist())
    expected = sorted(
        t.address + page * PAGE_SIZE
        for t, r in zip(store.tables, rows)
        for page in row_pages(r.reshape(-1) * t.row_bytes, t.row_bytes).tolist()
    )
    assert advised == expected
    # and the kernel really reads those pages
    del store.advisor.advise
    evict(tables)
    store.advise_rows(rows, merge=False)
    wanted = [set(row_pages(r.reshape(-1) * t.row_bytes, t.row_bytes).tolist()) for t, r in zip(store.tables, rows)]
    for want, now in zip(wanted, wait_resident(store, wanted)):
        assert want <= now


def ram_and_swap_bytes() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return sum(int(fields[name].split()[0]) * 1024 for name in ("MemTotal", "SwapTotal"))


def test_a_table_larger_than_ram_and_swap_maps_and_reads_at_both_ends(tmp_path):
    """Each table file is sparse (truncate: no disk), bigger than this host's RAM + swap, with real rows
    at its first and last row; the store maps it through the manifest and reads both."""
    limit = ram_and_swap_bytes()
    small = ModelConfig.from_dict(demo_config("tiny", 4096, 1))
    row_bytes = small.ngram_head_dim * 4
    base = (limit * 5 // 4) // (small.num_ngram_heads * row_bytes) + 1  # each head ~ base rows
    config = ModelConfig.from_dict(demo_config("tiny", 4096, 1, ple_overrides={"ngram_vocab_size_base": base}))
    tables = [PleLayerTable.expected(config, k, "float32") for k in range(len(config.ple_layer_ids))]
    expected = {}
    for table in tables:
        assert table.nbytes > limit
        path = tmp_path / table.file
        with open(path, "wb") as f:
            try:
                os.truncate(f.fileno(), table.nbytes)
            except OSError as exc:
                pytest.skip(f"{tmp_path}: no sparse file of {table.nbytes} bytes here ({exc})")
            for row in (0, table.rows - 1):
                values = np.arange(row_bytes // 4, dtype=np.float32) + 1000.0 * table.ple_index + (row > 0) * 0.5
                os.pwrite(f.fileno(), values.tobytes(), row * table.row_bytes)
                expected[table.ple_index, row] = values
        assert os.stat(path).st_blocks * 512 < 1 << 20  # really sparse
    manifest = {"format_version": FORMAT_VERSION, "layers": [asdict(t) for t in tables]}
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    try:
        if Path("/proc/sys/vm/overcommit_memory").read_text().strip() != "1":
            # what the store did before: a private writable mapping is charged against commit and refused
            with open(tmp_path / tables[0].file, "rb") as f, pytest.raises(OSError):
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        store = NgramStore(str(tmp_path), config, torch.device("cpu"))
        heads = config.num_ngram_heads
        last = [t.rows - 1 for t in tables]
        # per layer: token 0 reads row 0 in every head, token 1 the last row, token 2 both alternately
        rows = [np.array([[0] * heads, [end] * heads, [0, end] * (heads // 2)]) for end in last]
        got = store.gather(rows)
        for table, end in zip(tables, last):
            out = got[table.ple_index].view(3, heads, -1).numpy()
            first, final = expected[table.ple_index, 0], expected[table.ple_index, end]
            np.testing.assert_array_equal(out[0], np.stack([first] * heads))
            np.testing.assert_array_equal(out[1], np.stack([final] * heads))
            np.testing.assert_array_equal(out[2], np.stack([first, final] * (heads // 2)))
        assert store.sample_residency() < 0.01
    finally:
        for table in tables:
            (tmp_path / table.file).unlink()


def test_staging_buffers_are_sized_at_start_and_never_grow(model_with_tables):
    model, tables = model_with_tables
    config = ModelConfig.from_pretrained(model)
    store = NgramStore(str(tables), config, torch.device("cpu"), max_tokens=64)
    buffers = {index: staged[0].data_ptr() for index, staged in store._staging.items()}
    assert buffers and all(staged[0].shape[0] == 64 * config.num_ngram_heads for staged in store._staging.values())
    rng = np.random.default_rng(0)
    for length in (1, 64, 17, 64, 3):
        tokens = rng.integers(2, config.vocab_size, length)
        out = store.gather(store.rows_for(store.context_of([]), tokens))
        assert all(e.shape[0] == length for e in out.values())
    assert {index: staged[0].data_ptr() for index, staged in store._staging.items()} == buffers
    with pytest.raises(ValueError, match="exceeds the staging buffer"):
        store.gather(store.rows_for(store.context_of([]), rng.integers(2, config.vocab_size, 65)))
