"""`tierlm ple export`: flat table files equal the concatenated checkpoint shards; the manifest is checked
against the config and the files; user errors exit 2 with a message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tierlm.cli import main as cli_main
from tierlm.config import ModelConfig
from tierlm.demo_model import build_demo_model
from tierlm.memory import ple_table
from tierlm.memory.ple_table import MANIFEST, PleTableError, export_ple_tables, load_manifest
from tierlm.model.ngram_hash import NgramHashSpec


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("ple") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def config(model_dir) -> ModelConfig:
    return ModelConfig.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def tables(model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tables")
    export_ple_tables(model_dir, out, overwrite=True)
    return out


def _shard_bytes(model_dir: Path, layer: int) -> bytes:
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    prefix = f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.shard_"
    names = sorted(
        (n for n in weight_map if n.startswith(prefix)), key=lambda n: int(n[len(prefix) :].split(".")[0])
    )
    parts = []
    for name in names:
        with safe_open(model_dir / weight_map[name], framework="pt") as f:
            parts.append(f.get_tensor(name))
    assert len(parts) >= 2
    return torch.cat(parts).view(torch.uint8).numpy().tobytes()


def test_files_are_the_concatenated_shards(model_dir, config, tmp_path, monkeypatch):
    monkeypatch.setattr(
        ple_table, "PIECE_BYTES", 1000
    )  # several pieces per shard, one row at a time at least
    progress = []
    manifest = export_ple_tables(
        model_dir, tmp_path, on_bytes=lambda done, total: progress.append((done, total))
    )
    assert [t.layer for t in manifest.layers] == [i - 1 for i in config.ple_layer_ids]
    for table in manifest.layers:
        spec = NgramHashSpec.from_config(config, table.ple_index)
        assert table.rows == spec.table_rows and table.row_bytes == config.ngram_head_dim * 4
        assert table.dtype == "float32" and manifest.path(table) == tmp_path / f"layer{table.layer}.bin"
        assert manifest.path(table).read_bytes() == _shard_bytes(model_dir, table.layer)
    total = sum(t.nbytes for t in manifest.layers)
    assert progress[-1] == (total, total) and len(progress) > 10
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [MANIFEST] + [t.file for t in manifest.layers]
    )


def test_manifest_round_trip(tables, config):
    manifest = load_manifest(tables, config)
    raw = json.loads((tables / MANIFEST).read_text())
    assert raw["format_version"] == ple_table.FORMAT_VERSION
    for table, entry in zip(manifest.layers, raw["layers"], strict=True):
        spec = NgramHashSpec.from_config(config, table.ple_index)
        assert entry["multipliers"] == list(spec.multipliers) and entry["eos"] == config.eos_token_id
        assert entry["head_vocab_sizes"] == list(spec.head_sizes)
        assert entry["head_offsets"] == list(spec.head_offsets)
        assert (entry["num_heads"], entry["heads_per_ngram"], entry["ngram_size"], entry["seed"]) == (
            spec.num_heads,
            config.heads_per_ngram,
            config.ngram_size,
            config.seed,
        )
        assert entry["layer"] == table.layer and entry["file"] == table.file


def _tampered(tables: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(tables, copy)
    raw = json.loads((copy / MANIFEST).read_text())
    edit(raw, copy)
    (copy / MANIFEST).write_text(json.dumps(raw))
    return copy


def _set(index: int, field: str, value):
    def edit(raw, _folder):
        raw["layers"][index][field] = value

    return edit


def _truncate(raw, folder):
    file = folder / raw["layers"][1]["file"]
    file.write_bytes(file.read_bytes()[:-10])


@pytest.mark.parametrize(
    "edit,field,words",
    [
        (
            _set(0, "multipliers", [3, 5, 7]),
            "multipliers",
            ["layer 0", "multipliers", "expected [", "found [3, 5, 7]"],
        ),
        (_set(1, "rows", 128), "rows", ["layer 1", "rows", "found 128"]),
        (_truncate, "size of layer1.bin", ["layer 1", "size of layer1.bin", "bytes"]),
        (_set(0, "dtype", "int3"), "dtype", ["layer 0", "dtype", "found int3"]),
        (lambda raw, _: raw.update(format_version=99), "format_version", ["format_version", "found 99"]),
        (lambda raw, _: raw["layers"].pop(), "PLE layers", ["PLE layers", "expected [0, 1]", "found [0]"]),
    ],
)
def test_tampered_manifest_is_rejected(tables, config, tmp_path, edit, field, words):
    folder = _tampered(tables, tmp_path, edit)
    with pytest.raises(PleTableError) as caught:
        load_manifest(folder, config)
    assert caught.value.field == field and isinstance(caught.value, ValueError)
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))


def test_manifest_of_another_config_is_rejected(tables, model_dir, config):
    raw = json.loads((model_dir / "config.json").read_text())
    with pytest.raises(PleTableError, match="layer 0, multipliers"):
        load_manifest(tables, ModelConfig.from_dict({**raw, "seed": 99}))
    with pytest.raises(PleTableError, match="layer 0, row_bytes"):
        load_manifest(tables, ModelConfig.from_dict({**raw, "ple_embed_dim": 128}))
    with pytest.raises(PleTableError, match="manifest.json"):
        load_manifest(tables / "missing", config)


def test_cli_export_and_errors(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli_main(["ple", "export", str(model_dir), "--out", str(out)]) == 0
    assert "layer0.bin" in capsys.readouterr().out
    assert cli_main(["ple", "export", str(model_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierlm ple: error:") and "not empty" in err and "--force" in err
    assert cli_main(["ple", "export", str(model_dir), "--out", str(out), "--force"]) == 0
    assert cli_main(["ple", "export", str(tmp_path / "nope"), "--out", str(tmp_path / "o2")]) == 2
    assert "nope" in capsys.readouterr().err
    no_ple = tmp_path / "no_ple"
    no_ple.mkdir()
    (no_ple / "config.json").write_text(
        json.dumps({**json.loads((model_dir / "config.json").read_text()), "ple_layer_ids": []})
    )
    assert cli_main(["ple", "export", str(no_ple), "--out", str(tmp_path / "o3")]) == 2
    assert "no PLE layers" in capsys.readouterr().err


def test_checkpoint_that_does_not_fit_the_config_is_refused(model_dir, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    raw = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**raw, "split_ngram_parts": 8}))
    with pytest.raises(
        PleTableError, match=r"layer 0, table shards: expected shard_0 \.\. shard_7, found shard_0"
    ):
        export_ple_tables(copy, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # checked before anything is written
