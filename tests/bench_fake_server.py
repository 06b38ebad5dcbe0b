"""A scripted OpenAI-compatible streaming server on 127.0.0.1 for the `tierlm bench` tests.

Plain asyncio HTTP/1.1 (keep-alive, chunked transfer encoding) in a background thread, so a test
controls exactly what goes over the wire: the first output chunk after `first_token_delay_s`, then
one every `token_interval_s` (on an absolute schedule, so delays do not drift), and per request
(numbered 1, 2, ... in arrival order) one of these behaviours:

- "ok": the whole stream, a `usage` chunk if asked for, `data: [DONE]`;
- "http500": a 500 answer with a plain-text body;
- "cut": two output chunks, then the TCP connection is aborted;
- "no_done": every output chunk, then a clean end of the body without `[DONE]`;
- "malformed": two output chunks, then a chunk that is not JSON;
- "not_sse": a plain JSON answer, as from a server that ignores `stream: true`.

Answer text is `r{request number}t{index} ` per token, so a test can find an answer in a later
prompt. Every request's path, headers and JSON payload are kept in `requests`.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self


@dataclass
class FakeServerConfig:
    first_token_delay_s: float = 0.02
    token_interval_s: float = 0.005
    send_usage: bool = True  # answer stream_options.include_usage with a usage chunk
    reject_ignore_eos: bool = False  # answer 400 to requests carrying ignore_eos, like a strict server
    serve_metrics: bool = False  # expose tierlm: samples at /metrics
    behaviour: Callable[[int], str] = field(default=lambda number: "ok")


@dataclass
class ReceivedRequest:
    number: int
    path: str
    headers: dict[str, str]
    payload: dict


class FakeOpenAIServer:
    def __init__(self, config: FakeServerConfig | None = None):
        self.config = config or FakeServerConfig()
        self.requests: list[ReceivedRequest] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve_connection, "127.0.0.1", 0), self._loop
        ).result(timeout=10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc_info) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _shutdown(self) -> None:
        """Close the listening socket and every connection, then let the handlers see EOF and end
        (cancelling them instead makes asyncio log the cancellation as an error)."""
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if handlers:
            await asyncio.wait(handlers, timeout=5)

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                request_line = await reader.readline()
                if not request_line:
                    return
                method, path, _ = request_line.decode().split(" ", 2)
                headers = {}
                while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = line.decode().partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if not await self._respond(method, path, headers, body, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _respond(self, method: str, path: str, headers: dict, body: bytes, writer) -> bool:
        """Answer one request; False when the connection is gone afterwards."""
        if method == "GET" and path == "/metrics" and self.config.serve_metrics:
            served = len(self.requests)
            text = (
                "# HELP tierlm:requests_total Requests served.\n"
                "# TYPE tierlm:requests_total counter\n"
                f"tierlm:requests_total {served}\n"
                f'tierlm:kv_blocks_used{{tier="gpu"}} {served * 2}\n'
                "process_cpu_seconds_total 1.5\n"
                # speculative decoding, K = 2: per request 3 verify steps, 4 of 6 drafts accepted (3 first, 1 second)
                f'tierlm:spec_decode_num_drafts_total{{model_name="m"}} {served * 3}\n'
                f'tierlm:spec_decode_num_draft_tokens_total{{model_name="m"}} {served * 6}\n'
                f'tierlm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {served * 4}\n'
                f'tierlm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {served * 3}\n'
                f'tierlm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="1"}} {served}\n'
            )
            await self._send_whole(writer, 200, "text/plain", text)
            return True
        if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            await self._send_whole(writer, 404, "text/plain", "not found")
            return True
        payload = json.loads(body)
        number = len(self.requests) + 1
        self.requests.append(ReceivedRequest(number, path, headers, payload))
        if self.config.reject_ignore_eos and "ignore_eos" in payload:
            error = {"error": {"message": "Unrecognized request argument supplied: ignore_eos"}}
            await self._send_whole(writer, 400, "application/json", json.dumps(error))
            return True
        behaviour = self.config.behaviour(number)
        if behaviour == "http500":
            await self._send_whole(writer, 500, "text/plain", "fake server: internal failure")
            return True
        if behaviour == "not_sse":
            answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "whole"}}]}
            await self._send_whole(writer, 200, "application/json", json.dumps(answer))
            return True
        return await self._stream(writer, number, path.endswith("chat/completions"), payload, behaviour)

    async def _stream(self, writer, number: int, chat: bool, payload: dict, behaviour: str) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        if chat:  # real servers open with a role-only chunk that carries no text
            await self._send_event(
                writer, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
            )
        loop = asyncio.get_running_loop()
        started = loop.time()
        tokens = payload["max_tokens"]
        for index in range(tokens):
            due = started + self.config.first_token_delay_s + index * self.config.token_interval_s
            await asyncio.sleep(max(0.0, due - loop.time()))
            if index == 2 and behaviour == "cut":
                writer.transport.abort()
                return False
            if index == 2 and behaviour == "malformed":
                await self._send_chunk(writer, b"data: {not json\n\n")
                break
            text = f"r{number}t{index} "
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            await self._send_event(writer, {"choices": [choice]})
        if behaviour == "ok":
            if self.config.send_usage and (payload.get("stream_options") or {}).get("include_usage"):
                prompt = json.dumps(payload.get("messages") or payload.get("prompt"))
                usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": tokens}
                await self._send_event(writer, {"choices": [], "usage": usage})
            await self._send_chunk(writer, b"data: [DONE]\n\n")
        await self._send_chunk(writer, b"")  # the terminating zero-length chunk: a clean end
        return True

    async def _send_event(self, writer, event: dict) -> None:
        await self._send_chunk(writer, f"data: {json.dumps(event)}\n\n".encode())

    @staticmethod
    async def _send_chunk(writer, data: bytes) -> None:
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()

    @staticmethod
    async def _send_whole(writer, status: int, content_type: str, text: str) -> None:
        body = text.encode()
        head = f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
        writer.write(head.encode() + body)
        await writer.drain()
