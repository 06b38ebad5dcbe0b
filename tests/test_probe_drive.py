"""`tierlm probe-drive`: ordered percentiles and positive IOPS on a small file, the buffered fallback when
O_DIRECT is refused, stall detection, and bad arguments rejected with a message (exit 2)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tierlm.cli import main as cli_main
from tierlm.tools.probe_drive import STALL_FACTOR, find_stalls, parse_size


def _report(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def test_probe_creates_a_file_and_measures(tmp_path, capsys):
    path = tmp_path / "probe.bin"
    assert (
        cli_main(
            [
                "probe-drive",
                str(path),
                "--create-size",
                "2M",
                "--seconds",
                "0.3",
                "--queue-depth",
                "4",
                "--json",
            ]
        )
        == 0
    )
    report = _report(capsys)
    assert path.stat().st_size == 2 << 20 and path.read_bytes()[:4096].count(0) < 64  # really written
    assert report["size"] == 2 << 20 and report["block"] == 4096
    assert [r["queue_depth"] for r in report["results"]] == [1, 4]
    for r in report["results"]:
        assert r["reads"] > 0 and r["iops"] > 0
        assert 0 < r["p50_us"] <= r["p99_us"] <= r["p999_us"] <= r["max_us"]
    if report["direct"]:
        assert report["fallback_reason"] is None
    assert (
        cli_main(["probe-drive", str(path), "--seconds", "0.2", "--queue-depth", "1"]) == 0
    )  # existing file
    out = capsys.readouterr().out
    assert "QD   1" in out and "IOPS" in out and "p99.9" in out and out.count("QD") == 1


def test_fallback_when_o_direct_is_refused(tmp_path, capsys, monkeypatch):
    path = tmp_path / "probe.bin"
    path.write_bytes(os.urandom(64 << 10))
    real_open = os.open

    def refusing_open(file, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    assert cli_main(["probe-drive", str(path), "--seconds", "0.2", "--queue-depth", "2"]) == 0
    out = capsys.readouterr().out
    assert "BUFFERED reads (O_DIRECT refused by the filesystem (Invalid argument))" in out
    assert (
        cli_main(["probe-drive", str(path), "--seconds", "0.2", "--queue-depth", "2", "--buffered", "--json"])
        == 0
    )
    report = _report(capsys)
    assert report["direct"] is False and "--buffered" in report["fallback_reason"]


def test_find_stalls():
    # one read every ms of 50 us; from 1.0 s to 1.3 s the drive hangs: one read takes 300 ms
    starts = np.arange(0, 2.0, 0.001)
    starts = starts[(starts < 1.0) | (starts >= 1.3)]
    ends = starts + 50e-6
    starts, ends = np.append(starts, 1.0), np.append(ends, 1.3)
    order = np.argsort(ends)
    stalls = find_stalls(starts[order], ends[order], 50e-6)
    assert len(stalls) == 1
    assert stalls[0].start_s == pytest.approx(1.0) and stalls[0].duration_s == pytest.approx(0.3)
    assert stalls[0].worst_latency_us == pytest.approx(300_000)
    # slow windows (median above STALL_FACTOR x p50) also count, merged into one range
    slow = (ends > 0.5) & (ends < 0.7)
    starts2 = np.where(slow, ends - 2e-3, starts[order])
    stalls = find_stalls(starts2, ends, 2e-3 / (STALL_FACTOR * 2))
    assert [round(s.start_s, 1) for s in stalls] == [0.5, 1.0]


def test_parse_size():
    assert parse_size("4G") == 4 << 30 and parse_size("512M") == 512 << 20 and parse_size("4096") == 4096
    assert parse_size("64KiB") == 64 << 10


@pytest.mark.parametrize(
    "args,message",
    [
        (["{tmp}/missing.bin"], "does not exist; pass --create-size"),
        (["{tmp}/data.bin", "--seconds", "-1"], "--seconds -1 must be positive"),
        (["{tmp}/data.bin", "--block", "1000"], "multiple of 512"),
        (["{tmp}/small.bin"], "less than one block"),
        (["{tmp}/data.bin", "--queue-depth", "0"], "--queue-depth 0"),
        (["{tmp}/new.bin", "--create-size", "100"], "smaller than one block"),
        (["{tmp}"], "not a regular file"),
    ],
)
def test_bad_arguments(tmp_path, capsys, args, message):
    (tmp_path / "data.bin").write_bytes(b"\1" * 8192)
    (tmp_path / "small.bin").write_bytes(b"\1" * 100)
    assert cli_main(["probe-drive"] + [a.format(tmp=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierlm probe-drive: error:") and message in err, err
