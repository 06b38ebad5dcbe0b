"""What a person reads: the rich results table, the failed requests, the A/B table and the plot.

Everything here only formats numbers that `stats` computed; nothing is measured or derived here
except the per-turn TTFT samples the plot scatters.
"""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.table import Table

from tierlm.tools.bench.stats import LATENCY_METRICS, ComparisonRow, RunMeasurement

FAILURES_SHOWN = 20

_LATENCY_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}
_SCALAR_ROWS = (
    ("completed", "completed requests"),
    ("failed", "failed requests"),
    ("duration", "duration (s)"),
    ("request_throughput", "request throughput (req/s)"),
    ("output_throughput", "output throughput, total (tok/s)"),
    ("total_token_throughput", "input+output throughput (tok/s)"),
    ("mean_stream_output_throughput", "output tok/s per stream, mean"),
    ("median_stream_output_throughput", "output tok/s per stream, median"),
)


def _format(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:,.2f}"


def _metric_rows(turns: int) -> list[tuple[str, str]]:
    rows = list(_SCALAR_ROWS)
    for metric in LATENCY_METRICS:
        for stat in ("mean", "median", "p90", "p99", "max"):
            rows.append((f"{stat}_{metric}_ms", f"{_LATENCY_LABELS[metric]} {stat} (ms)"))
    if turns > 1:
        rows.extend((f"turn:{turn}", f"TTFT turn {turn + 1} median (ms)") for turn in range(turns))
    return rows


def _lookup(summary: dict, key: str):
    if key.startswith("turn:"):
        return summary["turn_ttfts_ms"][int(key.removeprefix("turn:"))]
    return summary.get(key)


def print_results(console: Console, result: dict) -> None:
    """The header line, then one column per measured run and, for several runs, one across them."""
    workload = (
        f"concurrency {result['max_concurrency']}"
        if result["request_rate"] is None
        else f"Poisson arrivals at {result['request_rate']} conversations/s"
    )
    console.print(
        f"[bold]tierlm bench[/bold] {result['model_id']} at {result['base_url']} ({result['endpoint']} API): "
        f"{result['lane']} lane, {workload}, {result['conversations_per_run']} conversations x "
        f"{result['turns']} turns per run, {result['prompt_tokens']} prompt / {result['output_tokens']} output tokens"
    )
    runs = result["runs"]
    table = Table(show_header=True, header_style="bold")
    table.add_column("metric")
    if len(runs) > 1:
        for summary in runs:
            table.add_column(f"run {summary['run'] + 1}", justify="right")
        table.add_column("across runs", justify="right", style="bold")
        table.caption = "across runs: counts are totals, everything else the median of the runs"
    else:
        table.add_column("value", justify="right")
    for key, label in _metric_rows(result["turns"]):
        cells = [_format(_lookup(summary, key)) for summary in runs] if len(runs) > 1 else []
        table.add_row(label, *cells, _format(_lookup(result, key)))
    console.print(table)


def print_speculative_decoding(console: Console, summary: dict) -> None:
    """One line: the server's speculative decoding during the benchmark (`stats.speculative_decoding`)."""
    rate = summary["acceptance_rate"]
    line = (f"speculative decoding (server /metrics): acceptance length {summary['acceptance_length']:.2f} "
            f"tokens per verify step; {summary['num_accepted_tokens']:,} of {summary['num_draft_tokens']:,} "
            f"drafts accepted ({'-' if rate is None else f'{rate:.1%}'})")
    if summary["acceptance_rate_per_position"]:
        line += "; by draft position " + ", ".join(f"{r:.1%}" for r in summary["acceptance_rate_per_position"])
    console.print(line)


def print_failures(console: Console, runs: list[RunMeasurement]) -> None:
    failed = [record for run in runs for record in run.records if not record.ok]
    if not failed:
        return
    table = Table(title=f"{len(failed)} failed requests", title_style="bold red", show_header=True)
    table.add_column("request")
    table.add_column("error")
    for record in failed[:FAILURES_SHOWN]:
        table.add_row(record.request_id, record.error)
    if len(failed) > FAILURES_SHOWN:
        table.caption = (
            f"... and {len(failed) - FAILURES_SHOWN} more: every error is in --result-json's `errors`"
        )
    console.print(table)


def print_notes(console: Console, notes: list[str]) -> None:
    for note in notes:
        console.print(f"[yellow]note:[/yellow] {note}")


def print_comparison(console: Console, rows: list[ComparisonRow], other_name: str) -> None:
    table = Table(title=f"A/B: this run vs {other_name}", show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("ours", justify="right")
    table.add_column("other", justify="right")
    table.add_column("ours/other", justify="right", style="bold")
    for row in rows:
        ratio = "-" if row.ratio is None else f"{row.ratio:.3f}"
        table.add_row(row.name, _format(row.ours), _format(row.other), ratio)
    console.print(table)


def write_plot(path: str, runs: list[RunMeasurement], turns: int, title: str) -> None:
    """Left: the inter-token latency of every stream of the last run over time. Right: the TTFT of
    every successful request of all runs by turn, with the median of each turn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(13, 4.8))
    FigureCanvasAgg(figure)
    itl_axes, ttft_axes = figure.subplots(1, 2)

    last = runs[-1]
    for record in last.records:
        if len(record.token_times_s) > 1:
            gaps_ms = [gap * 1000 for gap in record.itls_s]
            itl_axes.plot(record.token_times_s[1:], gaps_ms, linewidth=0.8, alpha=0.7)
    itl_axes.set_xlabel("time since the run started (s)")
    itl_axes.set_ylabel("inter-token latency (ms)")
    itl_axes.set_title(f"ITL per stream, run {last.index + 1}")

    medians = []
    for turn in range(turns):
        ttfts_ms = [r.ttft_s * 1000 for run in runs for r in run.records if r.ok and r.turn == turn]
        ttft_axes.scatter([turn + 1] * len(ttfts_ms), ttfts_ms, s=10, alpha=0.5, color="tab:blue")
        if ttfts_ms:
            medians.append((turn + 1, statistics.median(ttfts_ms)))
    if medians:
        ttft_axes.plot(*zip(*medians), color="tab:red", marker="o", label="median")
        ttft_axes.legend()
    ttft_axes.set_xlabel("turn")
    ttft_axes.set_ylabel("TTFT (ms)")
    ttft_axes.set_xticks(range(1, turns + 1))
    ttft_axes.set_title("TTFT per turn")

    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
