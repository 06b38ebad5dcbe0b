"""Serving throughput and prefix-cache TTFT of `tierlm serve`, measured from the client, in one run.

1. Total output tok/s at 1, 2, 4 and 8 concurrent streams (closed loop, `tierlm bench`), with the
   ratio to one stream.
2. TTFT of a second chat turn that shares ~90% of its prompt with the first (the first turn's message
   and answer, then a new message of ~10%), with prefix caching on vs off (two servers), as a ratio.

    python bench/serve_throughput.py                 # demo model (built if missing), CPU
    python bench/serve_throughput.py --model DIR --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from tierlm.tools.bench.client import GenerationSettings, ServerTarget, StreamedReply, StreamingClient

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(model: str, device: str, extra: list[str]):
    port = free_port()
    args = [sys.executable, "-m", "tierlm.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--device", device, *extra]
    with tempfile.TemporaryFile() as log:
        yield from _serve(args, log)


def _serve(args: list[str], log):
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    base = f"http://127.0.0.1:{args[args.index('--port') + 1]}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"server exited:\n{log.read().decode()[-3000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise RuntimeError("server did not become healthy in 300 s")
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def served_name(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]


def throughput(base: str, streams: int, prompt_tokens: int, output_tokens: int) -> float:
    """Total output tok/s of `streams` closed-loop streams, measured by `tierlm bench`."""
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        subprocess.run(
            [sys.executable, "-m", "tierlm.cli", "bench", "--base-url", base, "--model", served_name(base),
             "--endpoint", "completions", "--concurrency", str(streams), "--num-requests", str(3 * streams),
             "--prompt-tokens", str(prompt_tokens), "--output-tokens", str(output_tokens), "--lane", "warm",
             "--warmup", "1", "--runs", "1", "--no-progress", "--result-json", result.name],
            check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
        )
        return json.loads(Path(result.name).read_text())["output_throughput"]


def streamed_chat(base: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """(seconds to the first streamed content, the whole answer) of one chat completion, timed by
    `tierlm bench`'s client."""
    target = ServerTarget.from_base_url(base, served_name(base), "chat", api_key=None)
    settings = GenerationSettings(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)

    async def one() -> StreamedReply:
        async with httpx.AsyncClient(timeout=600) as http:
            return await StreamingClient(http, target, settings).complete(messages)

    reply = asyncio.run(one())
    if reply.error:
        raise RuntimeError(reply.error)
    return reply.token_times[0] - reply.sent_at, reply.text


def second_turn_ttft(base: str, first_message: str, follow_up: str) -> float:
    turn = [{"role": "user", "content": first_message}]
    _, answer = streamed_chat(base, turn, 32)
    turn += [{"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]
    ttft, _ = streamed_chat(base, turn, 8)
    return ttft


def conversation_text(words: int, seed: int) -> str:
    vocabulary = ("the", "model", "reads", "every", "token", "once", "and", "keeps", "its", "state", "in",
                  "slots", "while", "blocks", "of", "keys", "and", "values", "wait", "in", "the", "pool",
                  "for", "the", "next", "question", "about", "the", "code")
    return " ".join(vocabulary[(i * 7 + seed) % len(vocabulary)] for i in range(words))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the demo model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--turn-words", type=int, default=2500, help="first-turn message length in words")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from tierlm.demo_model import build_demo_model

        model = str(ROOT / "models" / "demo-tiny")
        if not (Path(model) / "config.json").exists():
            build_demo_model(model, "tiny")
    common = ["--max-num-seqs", "8", "--max-model-len", "4096"]

    print(f"model={model} device={args.device} prompt_tokens={args.prompt_tokens} output_tokens={args.output_tokens}")
    with server(model, args.device, common) as base:
        rates = {n: throughput(base, n, args.prompt_tokens, args.output_tokens) for n in (1, 2, 4, 8)}
    print(f"{'streams':>8}{'output tok/s':>15}{'vs 1 stream':>13}")
    for n, rate in rates.items():
        print(f"{n:>8}{rate:>15.1f}{rate / rates[1]:>12.2f}x")

    first, follow_up = conversation_text(args.turn_words, 1), conversation_text(args.turn_words // 9, 2)
    ttfts = {}
    for label, flag in (("prefix caching on", "--enable-prefix-caching"), ("prefix caching off", "--no-enable-prefix-caching")):
        with server(model, args.device, [*common, flag]) as base:
            streamed_chat(base, [{"role": "user", "content": conversation_text(50, 3)}], 4)  # warm-up
            ttfts[label] = second_turn_ttft(base, first, follow_up)
    on, off = ttfts["prefix caching on"], ttfts["prefix caching off"]
    print(f"second chat turn TTFT (~90% shared prefix): on {on * 1000:.1f} ms, off {off * 1000:.1f} ms, "
          f"ratio on/off {on / off:.3f}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
