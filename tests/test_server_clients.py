"""What one client can cost the others, against `tierlm serve` on the demo model: sampling edges in a
shared batch, a client that stops reading, connections that never finish a request, the concurrency
limit, and refused prompts that must not outlive their request (no reference cycles)."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from serve_process import serving

from tierlm.demo_model import build_demo_model

MODEL = "demo-tiny"
READ_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo") / MODEL
    build_demo_model(folder, "tiny")
    return folder


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    flags = [str(model_dir), "--dtype", "float32", "--device", "cpu", "--served-model-name", MODEL,
             "--max-model-len", "4200", "--max-num-seqs", "5", "--request-read-timeout", str(READ_TIMEOUT_S),
             "--max-stream-buffer-bytes", str(STREAM_BUFFER_BYTES)]
    with serving(flags, tmp_path_factory.mktemp("log") / "server.log") as process:
        yield {"url": process.url, "port": process.port, "pid": process.pid}


STREAM_BUFFER_BYTES = 256 << 10  # an unread stream pauses sooner than at the 4 MiB default: a shorter test


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _metric(url: str, name: str) -> float:
    """The sum of a metric's series (0 before any)."""
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def _stream(url: str, body: dict) -> tuple[list[dict], bool]:
    """Every event of a streamed completion, and whether [DONE] closed it."""
    events, done = [], False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events, done


def test_sampling_edges_in_a_shared_batch_fail_nobody(server):
    url = server["url"]
    healthy = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 40, "ignore_eos": True, "stream": True}
    edges = [
        {"prompt": "hi", "max_tokens": 2, "temperature": 1e-39},
        {"prompt": "hi", "max_tokens": 2, "top_p": 1e-46, "temperature": 1.0},
        {"prompt": "hi", "max_tokens": 0, "temperature": 1e-39, "echo": True, "logprobs": 1},
        {"prompt": "hi", "max_tokens": 2, "temperature": 5e-324, "top_p": 5e-324},
    ]
    greedy = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0},
                        timeout=60).json()["choices"][0]["text"]
    with ThreadPoolExecutor(7) as pool:
        streams = [pool.submit(_stream, url, healthy) for _ in range(3)]
        time.sleep(0.3)  # the streams are running: the edge cases join their batch
        answers = list(pool.map(lambda body: httpx.post(f"{url}/v1/completions", json=body, timeout=60), edges))
        for future in streams:
            events, done = future.result()
            assert done and events[-1]["choices"][0]["finish_reason"] == "length"
            assert not any("error" in e for e in events)
    assert [a.status_code for a in answers] == [200] * len(edges), [a.text for a in answers]
    assert answers[0].json()["choices"][0]["text"] == greedy  # below the temperature floor: greedy
    assert answers[1].json()["choices"][0]["text"] == greedy  # top_p keeps the most likely token
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_client_that_stops_reading_costs_bounded_memory(server):
    """4,000 tokens with 20 logprobs each, never read: the server holds deltas and pauses the request at its
    buffer bound once the socket's buffers are full, so its memory stays flat, not quadratic in the tokens.

    The client's SYN announces a small MSS (TCP_MAXSEG): Linux sizes the server's send buffer from it
    (~200 KB instead of ~4 MB at loopback's 64 KiB MSS), so the pause comes after ~300 tokens, not ~3,400
    (the issue's 20 s of unread generation, reached in a few seconds)."""
    url, pid = server["url"], server["pid"]
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 4000, "logprobs": 20, "ignore_eos": True,
                       "stream": True}).encode()
    finished = _metric(url, "tierlm:request_success_total")
    tokens_before = _metric(url, "tierlm:generation_tokens_total")
    before = _rss_bytes(pid)
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        client.connect(("127.0.0.1", server["port"]))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 600  # generous: the machine may be loaded
        while not _metric(url, "tierlm:num_streams_throttled"):
            assert _metric(url, "tierlm:request_success_total") == finished, "the unread stream was never paused"
            assert time.monotonic() < deadline, "the unread stream was not paused"
            time.sleep(0.2)
        time.sleep(0.5)  # a step launched before the pause may still land its token
        generated = _metric(url, "tierlm:generation_tokens_total")
        time.sleep(1.5)
        # paused, it computes only as the socket takes more bytes (the kernel grows its send buffer a little
        # at a time): far fewer tokens than it made before its first pause; a pause that did nothing would
        # keep the earlier pace (those tokens took well under 3 s on an idle machine)
        after_pause = _metric(url, "tierlm:generation_tokens_total") - generated
        assert after_pause < (generated - tokens_before) / 2, (after_pause, generated - tokens_before)
        grown = _rss_bytes(pid) - before
        assert grown < 50 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB for one unread stream"
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "y", "max_tokens": 3}, timeout=60)
        assert reply.status_code == 200  # the others are served meanwhile
    deadline = time.monotonic() + 30  # the client left: its request is aborted and its memory freed
    while _metric(url, "tierlm:num_requests_running") or _metric(url, "tierlm:num_streams_throttled"):
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                  b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro"])
def test_a_request_that_never_arrives_whole_is_dropped(server, sent):
    with socket.create_connection(("127.0.0.1", server["port"])) as client:
        client.sendall(sent)
        client.settimeout(READ_TIMEOUT_S * 10)
        started = time.monotonic()
        assert client.recv(1024) == b""  # closed by the server, not by our timeout
        assert time.monotonic() - started >= READ_TIMEOUT_S * 0.5
    assert httpx.get(f"{server['url']}/health", timeout=10).status_code == 200


def test_over_the_concurrency_limit_is_503(model_dir, tmp_path):
    flags = [str(model_dir), "--dtype", "float32", "--device", "cpu", "--limit-concurrency", "2"]
    with serving(flags, tmp_path / "server.log") as process:
        with socket.create_connection(("127.0.0.1", process.port)), socket.create_connection(("127.0.0.1", process.port)):
            time.sleep(0.2)
            assert httpx.get(f"{process.url}/health", timeout=10).status_code == 503
        deadline = time.monotonic() + 10
        while httpx.get(f"{process.url}/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_refused_prompts_are_freed_without_a_garbage_collection(model_dir):
    """Each refused prompt's token lists die with its request: no reference cycle keeps them."""
    from tierlm.engine.llm_engine import EngineConfig, LLMEngine
    from tierlm.server.api import build_app
    from tierlm.server.async_engine import AsyncEngine

    engine = AsyncEngine(LLMEngine(EngineConfig(str(model_dir), dtype="float32", device="cpu", max_model_len=256)), MODEL)
    app = build_app(engine, MODEL)
    length = 100_000

    def live_long_lists() -> int:
        return sum(1 for o in gc.get_objects() if type(o) is list and len(o) >= length)

    async def main() -> list[int]:
        engine.start()
        transport = httpx.ASGITransport(app=app)
        statuses = []
        async with httpx.AsyncClient(transport=transport, base_url="http://tierlm") as client:
            for i in range(4):  # each form twice: one refused prompt kept alive shows
                prompt = [(i + j) % 200 + 2 for j in range(length)] if i % 2 else "word " * length
                response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
                statuses.append(response.status_code)
        engine.stop()
        return statuses

    gc.collect()
    gc.disable()
    try:
        baseline = live_long_lists()
        statuses = asyncio.run(main())
        assert statuses == [400] * 4
        assert live_long_lists() == baseline
    finally:
        gc.enable()
