"""Numbers from timings: per-request records, per-run summaries, the result JSON and the A/B ratios.

Definitions (the same as `vllm bench serve`, so results can be read side by side):
- TTFT: from sending the request to the first chunk carrying output text;
- ITL: each gap between two consecutive chunks carrying output text;
- TPOT: (e2e latency - TTFT) / (output tokens - 1), for requests with more than one output token;
- E2EL: from sending the request to the end of its stream;
- stream output throughput: output tokens / E2EL of one request (what one user watching sees).
Percentiles are numpy's linear ones. A metric without data (say TPOT when every answer was one
token) is `None`, not 0.

The result JSON uses vLLM's field names. With several measured runs, counts (`completed`,
`failed`, `num_prompts`, token totals) and the per-request arrays cover all measured runs, in order
of run, conversation and turn, while rates, latencies and `duration` are medians of the per-run
values; each run's own summary is in `runs`. Per-request `ttfts` and `itls` are in seconds, as in
vLLM; every field ending in `_ms` is in milliseconds.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
LATENCY_STATISTICS = ("mean", "median", "std", "p90", "p99", "max")
COUNT_FIELDS = ("completed", "failed", "total_input_tokens", "total_output_tokens")

# The metrics `--compare` puts side by side, in display order.
COMPARED_FIELDS = (
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "mean_stream_output_throughput",
    *(f"{stat}_{metric}_ms" for metric in LATENCY_METRICS for stat in ("mean", "median", "p90", "p99")),
    "duration",
)


@dataclass
class RequestRecord:
    """One request's measurements, in seconds; `token_times_s` count from the start of its run."""

    run: int
    conversation: int
    turn: int
    ttft_s: float  # 0.0 when no output arrived
    e2el_s: float
    token_times_s: list[float] = field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0  # 0 for a failed request, as in vLLM
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def request_id(self) -> str:
        return f"run{self.run}/conv{self.conversation}/turn{self.turn}"

    @property
    def itls_s(self) -> list[float]:
        times = self.token_times_s
        return [later - earlier for earlier, later in itertools.pairwise(times)]

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class RunMeasurement:
    """The records of one run and how long it took from first send to last answer."""

    index: int
    records: list[RequestRecord]
    duration_s: float


def _latency_statistics(name: str, values_ms: list[float]) -> dict[str, float | None]:
    if not values_ms:
        return {f"{stat}_{name}_ms": None for stat in LATENCY_STATISTICS}
    array = np.asarray(values_ms, dtype=float)
    return {
        f"mean_{name}_ms": float(array.mean()),
        f"median_{name}_ms": float(np.median(array)),
        f"std_{name}_ms": float(array.std()),
        f"p90_{name}_ms": float(np.percentile(array, 90)),
        f"p99_{name}_ms": float(np.percentile(array, 99)),
        f"max_{name}_ms": float(array.max()),
    }


def turn_ttfts_ms(records: list[RequestRecord], turns: int) -> list[float | None]:
    """Median TTFT of the successful requests at each turn of the conversations."""
    medians: list[float | None] = []
    for turn in range(turns):
        values = [r.ttft_s * 1000 for r in records if r.ok and r.turn == turn]
        medians.append(float(np.median(values)) if values else None)
    return medians


def summarize_run(run: RunMeasurement, turns: int) -> dict:
    """A run's scalar metrics, named as in vLLM's result file."""
    done = [r for r in run.records if r.ok]
    duration = run.duration_s
    total_input = sum(r.input_tokens for r in done)
    total_output = sum(r.output_tokens for r in done)
    stream_rates = [r.output_tokens / r.e2el_s for r in done if r.e2el_s > 0]
    summary: dict = {
        "run": run.index,
        "completed": len(done),
        "failed": len(run.records) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "duration": duration,
        "request_throughput": len(done) / duration if duration > 0 else None,
        "output_throughput": total_output / duration if duration > 0 else None,
        "total_token_throughput": (total_input + total_output) / duration if duration > 0 else None,
        "mean_stream_output_throughput": float(np.mean(stream_rates)) if stream_rates else None,
        "median_stream_output_throughput": float(np.median(stream_rates)) if stream_rates else None,
    }
    samples_ms = {
        "ttft": [r.ttft_s * 1000 for r in done],
        "tpot": [r.tpot_s * 1000 for r in done if r.tpot_s is not None],
        "itl": [gap * 1000 for r in done for gap in r.itls_s],
        "e2el": [r.e2el_s * 1000 for r in done],
    }
    for name in LATENCY_METRICS:
        summary.update(_latency_statistics(name, samples_ms[name]))
    summary["turn_ttfts_ms"] = turn_ttfts_ms(run.records, turns)
    return summary


def _median_or_none(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return float(statistics.median(present)) if present else None


def across_runs(summaries: list[dict]) -> dict:
    """Counts summed over the runs, every other scalar the median of the runs (None ignored)."""
    combined: dict = {}
    for key in summaries[0]:
        if key == "run":
            continue
        if key in COUNT_FIELDS:
            combined[key] = sum(s[key] for s in summaries)
        elif key == "turn_ttfts_ms":
            combined[key] = [
                _median_or_none(list(per_turn)) for per_turn in zip(*(s[key] for s in summaries))
            ]
        else:
            combined[key] = _median_or_none([s[key] for s in summaries])
    return combined


def build_result(runs: list[RunMeasurement], turns: int, settings: dict) -> dict:
    """The `--result-json` document: `settings` (how the benchmark ran), the across-runs metrics,
    `runs` (each run's summary) and the per-request arrays."""
    summaries = [summarize_run(run, turns) for run in runs]
    records = [record for run in runs for record in run.records]
    result = dict(settings)
    result["num_prompts"] = len(records)
    result.update(across_runs(summaries))
    result["runs"] = summaries
    result["request_ids"] = [r.request_id for r in records]
    result["input_lens"] = [r.input_tokens for r in records]
    result["output_lens"] = [r.output_tokens for r in records]
    result["ttfts"] = [r.ttft_s for r in records]
    result["itls"] = [r.itls_s for r in records]
    result["errors"] = [r.error for r in records]
    return result


def speculative_decoding(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """What the server's speculative decoding did during the benchmark, from its `/metrics` snapshots
    (vLLM's spec_decode counters, summed over label sets): verify steps that carried drafts, drafts, accepted
    drafts, the acceptance rate, the acceptance length (tokens per verify step: 1 + accepted / verify
    steps, vLLM's definition) and the acceptance rate at each draft position. None without snapshots or
    without drafts in between."""
    if before is None or after is None:
        return None

    def grew(name: str) -> dict[str, float]:
        """Each series (key with labels) of `name`: its growth."""
        return {key: value - before.get(key, 0.0) for key, value in after.items() if key.split("{")[0] == name}

    drafts = sum(grew("tierlm:spec_decode_num_drafts_total").values())
    if drafts <= 0:
        return None
    draft_tokens = sum(grew("tierlm:spec_decode_num_draft_tokens_total").values())
    accepted = sum(grew("tierlm:spec_decode_num_accepted_tokens_total").values())
    by_position = {int(key.split('position="')[1].split('"')[0]): value
                   for key, value in grew("tierlm:spec_decode_num_accepted_tokens_per_pos_total").items()
                   if 'position="' in key}
    return {
        "num_drafts": int(drafts),
        "num_draft_tokens": int(draft_tokens),
        "num_accepted_tokens": int(accepted),
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "acceptance_length": 1.0 + accepted / drafts,
        "acceptance_rate_per_position": [by_position[j] / drafts for j in sorted(by_position)],
    }


@dataclass(frozen=True)
class ComparisonRow:
    name: str
    ours: float | None
    other: float | None

    @property
    def ratio(self) -> float | None:
        """ours / other; None when either is missing or other is 0."""
        if self.ours is None or self.other is None or self.other == 0:
            return None
        return self.ours / self.other


def compare_results(ours: dict, other: dict) -> list[ComparisonRow]:
    """The main metrics of two result documents side by side, per-turn TTFT included."""
    rows = [
        ComparisonRow(name, _number(ours.get(name)), _number(other.get(name))) for name in COMPARED_FIELDS
    ]
    our_turns = ours.get("turn_ttfts_ms") or []
    other_turns = other.get("turn_ttfts_ms") or []
    if len(our_turns) > 1 or len(other_turns) > 1:
        for turn in range(max(len(our_turns), len(other_turns))):
            rows.append(
                ComparisonRow(
                    f"turn {turn + 1} median_ttft_ms",
                    _number(our_turns[turn]) if turn < len(our_turns) else None,
                    _number(other_turns[turn]) if turn < len(other_turns) else None,
                )
            )
    return rows


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
