"""`tierlm bench` against a scripted streaming server on 127.0.0.1 (tests/bench_fake_server.py).

Timing assertions compare medians with the server's configured delays, with a tolerance of
+-25 ms, wide enough for a loaded 2-core machine and narrow enough to catch a wrong definition
(e.g. TTFT taken at the role-only first chunk, or ITL measured per request instead of per chunk).
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from bench_fake_server import FakeOpenAIServer, FakeServerConfig

from tierlm.cli import main
from tierlm.tools.bench.stats import ComparisonRow, compare_results

EARLY_MS = 5.0  # timer and scheduling granularity: how early a measured delay may read

ARRAY_FIELDS = ("ttfts", "itls", "input_lens", "output_lens", "errors", "request_ids")
VLLM_FIELDS = (
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "duration",
    "max_concurrency",
    "request_rate",
    *(
        f"{stat}_{metric}_ms"
        for metric in ("ttft", "tpot", "itl", "e2el")
        for stat in ("mean", "median", "p90", "p99")
    ),
    *ARRAY_FIELDS[:5],
)


def bench(
    server: FakeOpenAIServer | None, tmp_path: Path, *extra: str, base_url: str | None = None
) -> tuple[int, dict]:
    """Run `tierlm bench` in-process; return its exit status and result JSON ({} if none)."""
    result_file = tmp_path / "result.json"
    result_file.unlink(missing_ok=True)
    args = [
        "bench",
        "--base-url",
        base_url or server.url,
        "--model",
        "fake-model",
        "--no-progress",
        "--state-file",
        str(tmp_path / "state.json"),
        "--result-json",
        str(result_file),
        "--prompt-tokens",
        "32",
        "--output-tokens",
        "6",
        "--warmup",
        "0",
        "--timeout",
        "20",
        *extra,
    ]
    status = run_cli(args)
    return status, json.loads(result_file.read_text()) if result_file.exists() else {}


def run_cli(args: list[str]) -> int:
    try:
        return main(args)
    except SystemExit as exc:  # argparse errors exit from inside parse_args
        return exc.code


def user_messages(request) -> list[str]:
    payload = request.payload
    return [m["content"] for m in payload["messages"] if m["role"] == "user"]


def assert_consistent(result: dict, requests: int) -> None:
    for name in VLLM_FIELDS:
        assert name in result, name
    assert result["completed"] + result["failed"] == requests == result["num_prompts"]
    for name in ARRAY_FIELDS:
        assert len(result[name]) == requests, name
    assert result["failed"] == sum(1 for error in result["errors"] if error)
    assert result["total_output_tokens"] == sum(
        length for length, error in zip(result["output_lens"], result["errors"]) if not error
    )


def test_measured_ttft_and_itl_match_the_servers_delays(tmp_path):
    config = FakeServerConfig(first_token_delay_s=0.150, token_interval_s=0.040)
    with FakeOpenAIServer(config) as server:
        status, result = bench(
            server, tmp_path, "--num-requests", "6", "--concurrency", "2", "--output-tokens", "8"
        )
    assert status == 0
    assert_consistent(result, 6)
    assert result["failed"] == 0 and result["output_lens"] == [8] * 6  # from the usage chunk
    # a client can only measure late, never early (the server sleeps at least its delays), and a loaded
    # machine makes it later: tight lower bounds, upper bounds that still tell each figure from the wrong
    # one (a TTFT taken at the last token, an ITL over two intervals, an end-to-end time missing a token)
    assert 150 - EARLY_MS <= result["median_ttft_ms"] < 150 + 6 * 40
    assert 40 - EARLY_MS <= result["median_itl_ms"] < 2 * 40
    assert 40 - EARLY_MS <= result["median_tpot_ms"] < 2 * 40
    assert 150 + 7 * 40 - EARLY_MS <= result["median_e2el_ms"] < 2 * (150 + 7 * 40)
    assert statistics.median(result["ttfts"]) * 1000 == pytest.approx(result["median_ttft_ms"])  # seconds, as vLLM
    assert all(len(gaps) == 7 for gaps in result["itls"])
    assert result["max_concurrency"] == 2 and result["request_rate"] is None
    assert result["lane"] == "cold" and result["turn_ttfts_ms"] == [pytest.approx(result["median_ttft_ms"])]
    assert len(result["runs"]) == 1 and result["runs"][0]["completed"] == 6
    assert result["total_output_tokens"] == 48
    assert result["output_throughput"] == pytest.approx(48 / result["duration"])


def test_failures_and_truncations_are_counted_per_request(tmp_path, capsys):
    script = {2: "http500", 3: "cut", 4: "no_done", 5: "malformed", 6: "not_sse"}
    config = FakeServerConfig(behaviour=lambda number: script.get(number, "ok"))
    with FakeOpenAIServer(config) as server:
        status, result = bench(server, tmp_path, "--num-requests", "7", "--concurrency", "1")
    assert status == 0  # some requests succeeded
    assert_consistent(result, 7)
    assert (result["completed"], result["failed"]) == (2, 5)
    errors = result["errors"]
    assert errors[0] == errors[6] == ""
    assert errors[1].startswith("HTTP 500: fake server: internal failure")
    assert errors[2].startswith("connection cut mid-stream after 2 output chunks")
    assert errors[3].startswith("truncated stream: ended without [DONE] after 6 output chunks")
    assert errors[4].startswith("malformed JSON chunk after 2 output chunks")
    assert errors[5].startswith("no SSE events in the answer (Content-Type: application/json)")
    assert result["output_lens"][1:6] == [0] * 5
    out = capsys.readouterr().out
    assert "5 failed requests" in out and "run0/conv2/turn0" in out


def test_every_request_failing_exits_1(tmp_path, capsys):
    with FakeOpenAIServer(FakeServerConfig(behaviour=lambda number: "http500")) as server:
        status, result = bench(server, tmp_path, "--num-requests", "3")
    assert status == 1
    assert (result["completed"], result["failed"]) == (0, 3)
    assert result["mean_ttft_ms"] is None
    assert "every request failed" in capsys.readouterr().out


def test_unreachable_server_is_reported_and_exits_1(tmp_path):
    with FakeOpenAIServer() as server:
        closed_port_url = server.url  # nothing listens there once the server is gone
    status, result = bench(None, tmp_path, "--num-requests", "2", base_url=closed_port_url)
    assert status == 1
    assert all(error.startswith("unreachable:") for error in result["errors"])


def test_cold_lane_never_resends_text_across_invocations(tmp_path):
    with FakeOpenAIServer() as server:
        bench(server, tmp_path, "--num-requests", "4", "--concurrency", "2", "--warmup", "1")
        first = [user_messages(r)[0] for r in server.requests]
        bench(server, tmp_path, "--num-requests", "4", "--concurrency", "2", "--runs", "2")
        prompts = [user_messages(r)[0] for r in server.requests]
    assert len(first) == 8 and len(prompts) == 8 + 8
    assert len(set(prompts)) == len(prompts)
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["generator"] == {"0": 16}
    assert all(len(p) == 32 * 4 for p in prompts)  # ~4 characters per token without a tokenizer


def test_cold_lane_from_a_corpus_uses_fresh_offsets(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("alpha beta gamma delta " * 40)  # 920 characters: 7 prompts of 128
    (corpus / "b.txt").write_text("one two three four five " * 40)
    with FakeOpenAIServer() as server:
        bench(server, tmp_path, "--corpus", str(corpus), "--num-requests", "5")
        bench(server, tmp_path, "--corpus", str(corpus), "--num-requests", "5")
        prompts = [user_messages(r)[0] for r in server.requests]
        status, _ = bench(server, tmp_path, "--corpus", str(corpus), "--num-requests", "5")
        bench(server, tmp_path, "--corpus", str(corpus), "--num-requests", "2", "--lane", "warm")
        warm_prompts = [user_messages(r)[0] for r in server.requests[len(prompts) :]]
    texts = {"a": (corpus / "a.txt").read_text(), "b": (corpus / "b.txt").read_text()}
    assert texts["a"].startswith(prompts[0]) and prompts[1] == texts["a"][128:256]
    assert prompts[7] == texts["b"][:128]  # a.txt had room for 7 pieces
    offsets = json.loads((tmp_path / "state.json").read_text())["corpus"]
    assert offsets == {
        str((corpus / "a.txt").resolve()): len(texts["a"]),
        str((corpus / "b.txt").resolve()): 3 * 128,
    }
    assert status == 2  # the corpus is used up: 7 + 7 pieces hold only 14 prompts
    assert warm_prompts == [texts["a"][:128]] * 2  # the warm lane always takes the corpus's first piece


def test_warm_lane_sends_one_fixed_prompt(tmp_path):
    with FakeOpenAIServer() as server:
        status, result = bench(
            server, tmp_path, "--lane", "warm", "--num-requests", "3", "--concurrency", "3"
        )
        bench(server, tmp_path, "--lane", "warm", "--num-requests", "2")
        prompts = [user_messages(r)[0] for r in server.requests]
    assert status == 0 and result["lane"] == "warm"
    assert len(prompts) == 5 and len(set(prompts)) == 1
    assert not (tmp_path / "state.json").exists()  # the warm lane reserves nothing


def test_multi_turn_resends_the_growing_history_with_the_answers(tmp_path):
    with FakeOpenAIServer() as server:
        status, result = bench(server, tmp_path, "--turns", "3", "--num-requests", "2", "--concurrency", "2")
        requests = list(server.requests)
    assert status == 0
    assert_consistent(result, 6)
    assert len(result["turn_ttfts_ms"]) == 3 and all(t is not None for t in result["turn_ttfts_ms"])
    conversations: dict[str, list] = {}
    for request in requests:  # a conversation is named by its first user message
        conversations.setdefault(request.payload["messages"][0]["content"], []).append(request)
    assert len(conversations) == 2
    for turns in conversations.values():
        assert [len(r.payload["messages"]) for r in turns] == [1, 3, 5]
        for earlier, later in itertools.pairwise(turns):
            answer = "".join(f"r{earlier.number}t{i} " for i in range(6))
            assert (
                later.payload["messages"][: len(earlier.payload["messages"])] == earlier.payload["messages"]
            )
            assert later.payload["messages"][len(earlier.payload["messages"])] == {
                "role": "assistant",
                "content": answer,
            }
        new_user_texts = [r.payload["messages"][-1]["content"] for r in turns]
        assert len(set(new_user_texts)) == 3  # cold lane: every turn brings unseen text


def test_failed_turn_fails_the_rest_of_its_conversation(tmp_path):
    with FakeOpenAIServer(
        FakeServerConfig(behaviour=lambda number: "http500" if number == 1 else "ok")
    ) as server:
        status, result = bench(server, tmp_path, "--turns", "3", "--num-requests", "2", "--concurrency", "1")
    assert status == 0
    assert_consistent(result, 6)
    assert result["errors"][1] == result["errors"][2] == "not sent: turn 0 of this conversation failed"
    assert result["completed"] == 3


def test_image_requests_carry_an_image_before_the_first_message_text(tmp_path):
    """--image-size: a generated PNG of that size before the text of each conversation's first message
    (only there), one per conversation on the cold lane and one for all on the warm lane; --image FILE:
    the file's bytes."""
    import base64
    import io

    from PIL import Image

    def sent_images(requests) -> list[bytes]:
        images = []
        for request in requests:
            first, *rest = request.payload["messages"]
            image, text = first["content"]
            assert image["type"] == "image_url" and text["type"] == "text" and text["text"]
            assert all(isinstance(m["content"], str) for m in rest)
            header, data = image["image_url"]["url"].split(",", 1)
            images.append((header, base64.b64decode(data)))
        return images

    with FakeOpenAIServer() as server:
        status, result = bench(server, tmp_path, "--image-size", "40x24", "--num-requests", "3", "--turns", "2")
        cold = sent_images(server.requests)
        server.requests.clear()
        bench(server, tmp_path, "--image-size", "40x24", "--num-requests", "2", "--lane", "warm")
        warm = sent_images(server.requests)
        server.requests.clear()
        Image.new("RGB", (16, 8), (10, 200, 30)).save(tmp_path / "cat.jpg", format="JPEG")
        bench(server, tmp_path, "--image", str(tmp_path / "cat.jpg"), "--num-requests", "1")
        from_file = sent_images(server.requests)
    assert status == 0 and result["failed"] == 0 and result["image"] == "40x24"
    assert len(cold) == 6 and len({data for _, data in cold}) == 3  # turn 2 resends its conversation's image
    assert all(header == "data:image/png;base64" and Image.open(io.BytesIO(data)).size == (40, 24)
               for header, data in cold + warm)
    assert len({data for _, data in warm}) == 1
    assert from_file == [("data:image/jpeg;base64", (tmp_path / "cat.jpg").read_bytes())]


def test_completions_endpoint_sends_a_transcript(tmp_path):
    with FakeOpenAIServer() as server:
        status, result = bench(
            server, tmp_path, "--endpoint", "completions", "--turns", "2", "--num-requests", "1"
        )
        first, second = server.requests
    assert status == 0 and result["failed"] == 0
    assert first.path == second.path == "/v1/completions"
    assert second.payload["prompt"].startswith(
        "User: " + first.payload["prompt"] + "\n\nAssistant: r1t0 r1t1"
    )
    assert second.payload["prompt"].endswith("\n\nAssistant:")


def test_request_payload_flags_and_api_key(tmp_path):
    with FakeOpenAIServer() as server:
        bench(server, tmp_path, "--num-requests", "1", "--api-key", "secret-key", "--temperature", "0.5")
        bench(server, tmp_path, "--num-requests", "1", "--no-ignore-eos")
        forced, plain = (r.payload for r in server.requests)
        headers = server.requests[0].headers
    assert headers["authorization"] == "Bearer secret-key"
    assert forced["stream"] is True and forced["stream_options"] == {"include_usage": True}
    assert forced["max_tokens"] == forced["min_tokens"] == 6 and forced["ignore_eos"] is True
    assert forced["temperature"] == 0.5 and forced["model"] == "fake-model"
    assert "ignore_eos" not in plain and "min_tokens" not in plain


def test_server_rejecting_ignore_eos_gets_requests_without_it(tmp_path, capsys):
    with FakeOpenAIServer(FakeServerConfig(reject_ignore_eos=True)) as server:
        status, result = bench(server, tmp_path, "--num-requests", "3")
        payloads = [r.payload for r in server.requests]
    assert status == 0 and result["failed"] == 0 and result["ignore_eos"] is False
    assert "ignore_eos" in payloads[0] and all("ignore_eos" not in p for p in payloads[1:])
    assert len(payloads) == 4  # the rejected request was sent once more
    assert "rejected ignore_eos" in capsys.readouterr().out


def test_output_tokens_without_usage_come_from_the_tokenizer_or_the_chunks(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer_file = tmp_path / "tokenizer.json"
    tokenizer.save(str(tokenizer_file))
    with FakeOpenAIServer(FakeServerConfig(send_usage=False)) as server:
        _, by_tokenizer = bench(
            server,
            tmp_path,
            "--num-requests",
            "2",
            "--tokenizer",
            str(tokenizer_file),
            "--prompt-tokens",
            "20",
        )
        prompts = [user_messages(r)[0] for r in server.requests]
        _, by_chunks = bench(server, tmp_path, "--num-requests", "2")
    assert by_tokenizer["output_lens"] == by_chunks["output_lens"] == [6, 6]
    assert [len(tokenizer.encode(p).ids) for p in prompts] == [20, 20]  # prompts fitted to the token count
    assert by_tokenizer["input_lens"] == [20, 20]


def test_tierlm_metrics_snapshot_before_and_after(tmp_path, capsys):
    with FakeOpenAIServer(FakeServerConfig(serve_metrics=True)) as server:
        _, result = bench(server, tmp_path, "--num-requests", "2", "--warmup", "1")
    before = result["server_metrics_before"]
    assert before["tierlm:requests_total"] == 2 and before['tierlm:kv_blocks_used{tier="gpu"}'] == 4
    assert "process_cpu_seconds_total" not in before
    assert result["server_metrics_after"]["tierlm:requests_total"] == 4
    # the 2 measured requests' speculative decoding: 6 verify steps, 8 of 12 drafts accepted (6 first, 2 second)
    assert result["speculative_decoding"] == {
        "num_drafts": 6, "num_draft_tokens": 12, "num_accepted_tokens": 8, "acceptance_rate": 8 / 12,
        "acceptance_length": 1 + 8 / 6, "acceptance_rate_per_position": [1.0, 2 / 6],
    }
    assert "acceptance length 2.33 tokens per verify step" in " ".join(capsys.readouterr().out.split())
    with FakeOpenAIServer() as server:  # /metrics answers 404: no snapshot, no complaint
        status, result = bench(server, tmp_path, "--num-requests", "1")
    assert status == 0 and "server_metrics_before" not in result


def test_open_loop_poisson_arrivals_and_several_runs(tmp_path, capsys):
    with FakeOpenAIServer() as server:
        status, result = bench(
            server,
            tmp_path,
            "--request-rate",
            "40",
            "--num-requests",
            "5",
            "--runs",
            "2",
            "--warmup",
            "1",
            "--base-url",
            server.url + "/v1/",
        )
        sent = len(server.requests)
    assert status == 0 and sent == 15  # the warmup run is sent but not reported
    assert_consistent(result, 10)
    assert result["request_rate"] == 40 and result["max_concurrency"] is None
    assert [run["completed"] for run in result["runs"]] == [5, 5]
    assert result["median_ttft_ms"] == pytest.approx(
        statistics.median(run["median_ttft_ms"] for run in result["runs"])
    )
    assert "across runs" in capsys.readouterr().out


def test_compare_ratios(tmp_path, capsys):
    ours = {"mean_ttft_ms": 50.0, "output_throughput": 300.0, "failed": 0, "turn_ttfts_ms": [10.0, 30.0]}
    other = {"mean_ttft_ms": 100.0, "output_throughput": 200.0, "failed": 0, "turn_ttfts_ms": [20.0, 20.0]}
    rows = {row.name: row for row in compare_results(ours, other)}
    assert rows["mean_ttft_ms"].ratio == pytest.approx(0.5)
    assert rows["output_throughput"].ratio == pytest.approx(1.5)
    assert rows["failed"].ratio is None  # 0/0
    assert rows["p99_itl_ms"] == ComparisonRow("p99_itl_ms", None, None)
    assert rows["turn 2 median_ttft_ms"].ratio == pytest.approx(1.5)

    with FakeOpenAIServer() as server:
        _, first = bench(server, tmp_path, "--num-requests", "2")
        other_file = tmp_path / "other.json"
        doctored = dict(first, mean_ttft_ms=first["mean_ttft_ms"] * 4)
        other_file.write_text(json.dumps(doctored))
        status, second = bench(server, tmp_path, "--num-requests", "2", "--compare", str(other_file))
    assert status == 0
    out = capsys.readouterr().out
    assert "A/B: this run vs" in out
    ratio = second["mean_ttft_ms"] / doctored["mean_ttft_ms"]
    assert f"{ratio:.3f}" in out.split("mean_ttft_ms", 1)[1].splitlines()[0]


def test_plot_is_written(tmp_path):
    plot = tmp_path / "bench.png"
    with FakeOpenAIServer() as server:
        status, _ = bench(server, tmp_path, "--num-requests", "2", "--turns", "2", "--plot", str(plot))
    assert status == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--concurrency", "0"], "--concurrency: must be a positive integer"),
        (["--concurrency", "-3"], "--concurrency: must be a positive integer"),
        (["--concurrency", "2", "--request-rate", "1"], "not allowed with argument --concurrency"),
        (["--request-rate", "0"], "--request-rate: must be a positive number"),
        (["--num-requests", "zero"], "not a valid int"),
        (["--corpus", "/no/such/corpus/dir"], "--corpus: /no/such/corpus/dir is not a directory"),
        (["--compare", "/no/such/result.json"], "--compare: no such file"),
        (["--tokenizer", "/no/such/tokenizer.json"], "--tokenizer: no tokenizer file"),
        (["--base-url", "127.0.0.1:8000"], "--base-url must start with http://"),
        (["--image", "/no/such/image.png"], "--image: no such file"),
        (["--image-size", "0x64"], "--image-size must read WIDTHxHEIGHT"),
        (["--image-size", "64x64", "--endpoint", "completions"], "need --endpoint chat"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(tmp_path, capsys, extra, message):
    args = [
        "bench",
        "--base-url",
        "http://127.0.0.1:9",
        "--model",
        "m",
        "--state-file",
        str(tmp_path / "s.json"),
        "--no-progress",
        *extra,
    ]
    assert run_cli(args) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.strip().splitlines()[-1].startswith("tierlm bench: error:")
    assert not (tmp_path / "s.json").exists()  # nothing was reserved or sent


def test_help_works(capsys):
    assert run_cli(["bench", "--help"]) == 0
    assert "--request-rate" in capsys.readouterr().out


def test_the_bench_package_does_not_import_torch():
    code = (
        "import sys\n"
        "from tierlm.tools.bench import cli, client, report, runner, stats, workload\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
