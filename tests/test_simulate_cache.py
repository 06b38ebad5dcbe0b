"""`tierlm simulate-cache`: the O(n) LRU equals a dictionary LRU, the figures are consistent on small
traces, and bad arguments exit 2 with a message."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from tierlm.cli import main as cli_main
from tierlm.config import ModelConfig
from tierlm.demo_model import build_demo_model
from tierlm.model.ngram_hash import NgramHashSpec
from tierlm.tools import simulate_cache
from tierlm.tools.simulate_cache import (
    PAGE_BYTES,
    AccessTrace,
    Reuse,
    hot_set_misses,
    lru_misses,
    page_trace,
    phase_figures,
    phase_of_tokens,
    row_trace,
)


def reference_lru_misses(keys: np.ndarray, capacity: int) -> np.ndarray:
    """The plain LRU: an ordered dictionary."""
    cache: OrderedDict[int, None] = OrderedDict()
    missed = []
    for key in keys.tolist():
        if key in cache:
            cache.move_to_end(key)
            missed.append(False)
        else:
            cache[key] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
            missed.append(True)
    return np.array(missed, dtype=bool)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("sim") / "tiny", "tiny", seed=0)


@pytest.mark.parametrize("packed", [True, False])
def test_lru_equals_dictionary_lru(packed, monkeypatch):
    rng = np.random.default_rng(1)
    keys = (rng.zipf(1.3, 20_000) % 3_000).astype(np.int64)
    if not packed:  # keys too large to pack with their position: the argsort path
        keys = keys + (1 << 60)
    monkeypatch.setattr(simulate_cache, "_CHUNK", 4096)  # several chunks in the loop
    reuse = Reuse.of(keys)
    for capacity in (1, 2, 3, 17, 256, 2_999, 3_000, 50_000):
        assert np.array_equal(lru_misses(reuse, capacity), reference_lru_misses(keys, capacity)), capacity


def test_reuse_links():
    keys = np.array([5, 7, 5, 5, 9, 7], dtype=np.int64)
    reuse = Reuse.of(keys)
    assert reuse.prev.tolist() == [-1, -1, 0, 2, -1, 1]
    assert reuse.next.tolist() == [2, 5, 3, 6, 6, 6]
    assert reuse.group.tolist() == [0, 1, 0, 0, 2, 1] and reuse.counts.tolist() == [3, 2, 1]


def test_small_traces():
    alternating = np.array([1, 2] * 50, dtype=np.int64)
    reuse = Reuse.of(alternating)
    assert lru_misses(reuse, 1).all()  # a 1-key LRU on an alternating trace misses every time
    assert lru_misses(reuse, 2).sum() == 2
    keys = np.random.default_rng(0).integers(0, 500, 5_000)
    reuse = Reuse.of(keys)
    # a cache bigger than the trace misses once per distinct key (the warm-up), nothing after
    assert lru_misses(reuse, 10_000).sum() == len(np.unique(keys)) == len(reuse.counts)
    assert not hot_set_misses(reuse, len(reuse.counts)).any()  # a hot set of all keys never misses
    counts = np.bincount(keys, minlength=500)
    by_heat = sorted(range(500), key=lambda key: (-counts[key], key))  # most frequent first, then smaller
    for capacity in (1, 2, 7, 100, 499):
        assert np.array_equal(hot_set_misses(reuse, capacity), ~np.isin(keys, by_heat[:capacity])), capacity
    ties = np.array([3, 3, 1, 1, 2], dtype=np.int64)
    assert hot_set_misses(Reuse.of(ties), 1).tolist() == [True, True, False, False, True]


def test_phases_and_pages(model_dir):
    config = ModelConfig.from_pretrained(model_dir)
    specs = [NgramHashSpec.from_config(config, k) for k in range(len(config.ple_layer_ids))]
    rng = np.random.default_rng(2)
    requests = [rng.integers(0, config.vocab_size, n) for n in (40, 13, 1)]
    is_decode = phase_of_tokens([40, 13, 1], 0.25)
    assert is_decode.tolist() == [False] * 30 + [True] * 10 + [False] * 10 + [True] * 3 + [False]
    rows = row_trace(specs, requests)
    heads = specs[0].num_heads
    assert rows.shape == (54, 2 * heads)
    assert (rows[:, :heads] < specs[0].table_rows).all() and (rows[:, heads:] >= specs[0].table_rows).all()
    for row_bytes in (64, 320, 1000, PAGE_BYTES):
        pages = page_trace(rows, specs, row_bytes, is_decode)
        # reference: each layer's file starts at a page of its own, after the previous layers' pages
        layer_pages = [0, -(-specs[0].table_rows * row_bytes // PAGE_BYTES)]
        expected_keys, expected_tokens = [], []
        for token, token_rows in enumerate(rows.tolist()):
            for column, row in enumerate(token_rows):
                layer = column // heads
                local = row - layer * specs[0].table_rows
                first = local * row_bytes // PAGE_BYTES
                last = (local * row_bytes + row_bytes - 1) // PAGE_BYTES
                for page in dict.fromkeys([first, last]):
                    expected_keys.append(layer_pages[layer] + page)
                    expected_tokens.append(token)
        starts = np.searchsorted(expected_tokens, np.arange(len(rows)))
        assert pages.keys.tolist() == expected_keys and pages.token_starts.tolist() == starts.tolist()
    with pytest.raises(ValueError, match="larger than a page"):
        page_trace(rows, specs, PAGE_BYTES + 1, is_decode)
    trace = AccessTrace.of_rows(rows, is_decode)
    figures = phase_figures(trace, np.ones(rows.size, dtype=bool))
    assert figures["decode"].tokens == 13 and figures["prefill"].tokens == 41
    assert figures["decode"].misses_per_token == 2 * heads and figures["decode"].share_of_steps_with_miss == 1
    figures = phase_figures(trace, np.zeros(rows.size, dtype=bool))
    assert figures["prefill"].miss_rate == 0 and figures["decode"].steps_with_miss == 0


def test_cli(model_dir, tmp_path, capsys):
    config = ModelConfig.from_pretrained(model_dir)
    ids = tmp_path / "a.txt"
    ids.write_text(" ".join(str(i) for i in [5, 6, 7, 5, 6, 7] * 20) + "\n")
    np.save(tmp_path / "b.npy", np.arange(100, 160))
    sizes = [
        "--row-cache-rows",
        "1",
        "100000",
        "--hot-set-rows",
        "100000",
        "--page-cache-pages",
        "1",
        "100000",
    ]
    base = [
        "simulate-cache",
        "--model",
        str(model_dir),
        "--token-ids",
        str(ids),
        str(tmp_path / "b.npy"),
        *sizes,
    ]
    assert cli_main([*base, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["requests"], report["tokens"], report["decode_tokens"]) == (2, 180, 30 + 15)
    per_token = report["row_reads_per_token"]
    assert per_token == len(config.ple_layer_ids) * config.num_ngram_heads and report["row_bytes"] == 64
    lru_1, lru_big, hot, page_1, page_big = report["results"]
    assert [r["cache"] for r in report["results"]] == ["LRU row cache"] * 2 + ["hot set (oracle)"] + [
        "page cache"
    ] * 2
    for result in report["results"]:
        assert result["prefill"]["tokens"] + result["decode"]["tokens"] == 180
        assert result["prefill"]["reads"] == 135 * per_token and result["decode"]["reads"] == 45 * per_token
    assert (
        lru_1["decode"]["misses_per_token"] == per_token and lru_1["decode"]["share_of_steps_with_miss"] == 1
    )
    assert lru_big["prefill"]["misses"] + lru_big["decode"]["misses"] == report["distinct_rows"]
    assert hot["prefill"]["misses"] == hot["decode"]["misses"] == 0
    assert page_big["prefill"]["misses"] + page_big["decode"]["misses"] == report["distinct_pages"]
    # request a repeats one 3-token cycle: once warm, its decode steps read nothing from the drive
    assert lru_big["decode"]["steps_with_miss"] <= 15 and page_1["decode"]["share_of_steps_with_miss"] == 1
    assert cli_main(base) == 0
    table = capsys.readouterr().out
    assert "180 tokens" in table and "hot set (oracle)" in table and "steps w/ drive read" in table
    text = tmp_path / "c.txt"
    text.write_text("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 5)
    assert (
        cli_main(
            [
                "simulate-cache",
                "--model",
                str(model_dir),
                "--text",
                str(text),
                "--row-cache-rows",
                "64",
                "--decode-fraction",
                "0.5",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["tokens"] > 50


@pytest.mark.parametrize(
    "args,message",
    [
        (["--token-ids", "{tmp}/a.txt"], "give at least one size"),
        (["--token-ids", "{tmp}/a.txt", "--row-cache-rows", "0"], "must be positive"),
        (["--token-ids", "{tmp}/missing.txt", "--row-cache-rows", "5"], "cannot read"),
        (["--token-ids", "{tmp}/bad.txt", "--row-cache-rows", "5"], "not token ids"),
        (
            ["--token-ids", "{tmp}/a.txt", "--row-cache-rows", "5", "--decode-fraction", "1.5"],
            "decode-fraction",
        ),
    ],
)
def test_cli_errors(model_dir, tmp_path, capsys, args, message):
    (tmp_path / "a.txt").write_text("1 2 3")
    (tmp_path / "bad.txt").write_text("1 two 3")
    argv = ["simulate-cache", "--model", str(model_dir)] + [a.format(tmp=tmp_path) for a in args]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierlm simulate-cache: error:") and message in err, err


def test_cli_missing_model(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("1 2 3")
    assert (
        cli_main(
            [
                "simulate-cache",
                "--model",
                str(tmp_path / "nope"),
                "--token-ids",
                str(tmp_path / "a.txt"),
                "--row-cache-rows",
                "5",
            ]
        )
        == 2
    )
    assert "nope" in capsys.readouterr().err
