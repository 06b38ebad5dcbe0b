"""Nothing stalls the server: /health latency while it streams and while huge bodies arrive.

Starts `tierlm serve` on the demo model (or --model), then at once: --streams chat streams (half of them
cut off after 1-5 chunks), --big requests whose prompt is a body of --big-bytes (tokenized off the event
loop, then refused as longer than the context), and a probe of /health every 20 ms. Prints the /health
latency (median, p99, max; the issue's target: within 100 ms throughout), how many uncut streams
finished, the engine's running / waiting requests afterwards (target: none) and the server's RSS before
and after (target: within 10%).

    python bench/server_load.py                       # demo model, CPU
    python bench/server_load.py --model DIR --device cuda --streams 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tierlm.demo_model import build_demo_model


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def stream(client: httpx.AsyncClient, cut_after: int | None, max_tokens: int) -> bool:
    """One chat stream; True if it ran to [DONE] (or was cut as planned)."""
    body = {"messages": [{"role": "user", "content": "Write a parser."}], "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    chunks = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return True
            if line.startswith("data: "):
                chunks += 1
                if cut_after is not None and chunks >= cut_after:
                    return True  # leaving the block closes the connection
    return False


async def big(client: httpx.AsyncClient, size: int) -> int:
    prompt = ("word " * (size // 5 + 1))[: size - 64]
    response = await client.post("/v1/completions", content=json.dumps({"prompt": prompt, "max_tokens": 1}))
    return response.status_code


async def load(url: str, args) -> None:
    latencies: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            while not done.is_set():
                start = time.perf_counter()
                await client.get("/health")
                latencies.append((time.perf_counter() - start) * 1e3)
                await asyncio.sleep(0.02)

    rng = random.Random(0)
    limits = httpx.Limits(max_connections=args.streams + args.big + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        probing = asyncio.create_task(probe())
        cuts = [rng.randint(1, 5) if i % 2 else None for i in range(args.streams)]
        results = await asyncio.gather(*(stream(client, c, args.max_tokens) for c in cuts),
                                       *(big(client, args.big_bytes) for _ in range(args.big)))
        done.set()
        await probing
        await asyncio.sleep(1.0)  # the aborted requests leave the engine
        text = (await client.get("/metrics")).text
    streams, codes = results[: args.streams], results[args.streams :]
    uncut = [ok for ok, cut in zip(streams, cuts, strict=True) if cut is None]
    latencies.sort()
    print(f"/health over {len(latencies)} probes: median {latencies[len(latencies) // 2]:.1f} ms, "
          f"p99 {latencies[int(len(latencies) * 0.99)]:.1f} ms, max {latencies[-1]:.1f} ms (target: < 100 ms)")
    print(f"uncut streams finished: {sum(uncut)} / {len(uncut)}; big bodies answered {sorted(set(codes))}")
    print(f"afterwards: running {metric(text, 'tierlm:num_requests_running'):.0f}, "
          f"waiting {metric(text, 'tierlm:num_requests_waiting'):.0f} (target: 0, 0)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--big", type=int, default=8)
    parser.add_argument("--big-bytes", type=int, default=8 << 20)
    args = parser.parse_args()
    model = args.model
    if model is None:
        model = str(Path(tempfile.gettempdir()) / "tierlm-bench-demo-tiny")
        if not (Path(model) / "config.json").is_file():
            build_demo_model(model, "tiny", overwrite=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "tierlm.cli", "serve", model, "--port", str(port), "--device", args.device,
               "--max-num-seqs", "16", "--max-model-len", "4096", "--max-request-bytes", str(args.big_bytes + 1024)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
            if server.poll() is not None:
                raise SystemExit("tierlm serve did not start")
        before = rss_bytes(server.pid)
        asyncio.run(load(url, args))
        after = rss_bytes(server.pid)
        print(f"server RSS: {before / 2**20:.0f} MiB before, {after / 2**20:.0f} MiB after "
              f"({after / before:.2f}x; target: within 1.10x)")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
