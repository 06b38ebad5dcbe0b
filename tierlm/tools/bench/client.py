"""One streamed request to an OpenAI-compatible server, timed chunk by chunk, and its failures.

`StreamingClient.complete` sends a chat or completions request with `stream: true`, stamps every
SSE line with `time.perf_counter()` the moment httpx hands it over, and returns a `StreamedReply`:
the arrival times of the chunks that carried output text, the text, the `usage` the server reported
(requested with `stream_options.include_usage`), the HTTP status and, for a failed request, a
one-line error. A request fails when the server is unreachable, answers non-200 (status and a
snippet of the body are kept), times out, cuts the connection, sends a malformed or error chunk,
ends the stream without `[DONE]`, or finishes without any output. Nothing here raises for those:
the benchmark counts and reports every failure.

`ignore_eos`/`min_tokens` make the server generate exactly `max_tokens`; they are vLLM (and tierlm)
extensions, so when a server rejects them with a 400/422 naming them, the client stops sending them
(and says so in `notes`) and retries that request once.

`scrape_tierlm_metrics` reads the `tierlm:` samples of the server's Prometheus `/metrics`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

BODY_SNIPPET_CHARS = 200
EOS_EXTENSIONS = ("ignore_eos", "min_tokens")


@dataclass(frozen=True)
class ServerTarget:
    """Where requests go: `api_base` ends in `/v1`, `server_root` is the same without it."""

    server_root: str
    model: str
    endpoint: str  # "chat" or "completions"
    api_key: str | None = None

    @classmethod
    def from_base_url(cls, base_url: str, model: str, endpoint: str, api_key: str | None) -> ServerTarget:
        """Accept the server root or its `/v1` URL: `http://host:8000` and `http://host:8000/v1`."""
        root = base_url.rstrip("/")
        root = root.removesuffix("/v1")
        return cls(server_root=root, model=model, endpoint=endpoint, api_key=api_key)

    @property
    def api_base(self) -> str:
        return self.server_root + "/v1"

    @property
    def url(self) -> str:
        path = "/chat/completions" if self.endpoint == "chat" else "/completions"
        return self.api_base + path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class GenerationSettings:
    """What every request asks for; `ignore_eos` is switched off if the server rejects it."""

    max_tokens: int
    ignore_eos: bool
    temperature: float


def message_text(content: str | list[dict]) -> str:
    """A message's text: its content, or the text of its text parts (an image part has none)."""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part.get("type") == "text")


def render_transcript(messages: list[dict]) -> str:
    """The prompt for the completions API: a lone user message as is, a conversation as a
    `User:`/`Assistant:` transcript ending where the assistant speaks next (images have no text)."""
    if len(messages) == 1:
        return message_text(messages[0]["content"])
    speaker = {"user": "User", "assistant": "Assistant"}
    lines = [f"{speaker[m['role']]}: {message_text(m['content'])}" for m in messages]
    return "\n\n".join(lines) + "\n\nAssistant:"


def build_payload(target: ServerTarget, settings: GenerationSettings, messages: list[dict]) -> dict:
    payload: dict = {
        "model": target.model,
        "max_tokens": settings.max_tokens,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.endpoint == "chat":
        payload["messages"] = messages
    else:
        payload["prompt"] = render_transcript(messages)
    if settings.ignore_eos:
        payload["ignore_eos"] = True
        payload["min_tokens"] = settings.max_tokens
    return payload


@dataclass
class StreamedReply:
    """What one request saw. Times are `time.perf_counter()` values."""

    sent_at: float
    finished_at: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each chunk with output text
    text: str = ""  # the assistant's visible answer (reasoning text excluded)
    all_output_text: str = ""  # visible answer and reasoning text, for counting tokens
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    status: int | None = None
    error: str = ""


def _chunk_output(chunk: dict, endpoint: str) -> tuple[str, str]:
    """(visible text, reasoning text) carried by one SSE chunk."""
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return "", ""
    choice = choices[0]
    if endpoint == "completions":
        return choice.get("text") or "", ""
    delta = choice.get("delta") or {}
    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
    return delta.get("content") or "", reasoning


class StreamingClient:
    """Sends streamed requests through one shared httpx connection pool."""

    def __init__(self, http: httpx.AsyncClient, target: ServerTarget, settings: GenerationSettings):
        self.http = http
        self.target = target
        self.settings = settings
        self.notes: list[str] = []

    async def complete(self, messages: list[dict]) -> StreamedReply:
        sent_with_extensions = self.settings.ignore_eos
        reply = await self._stream(messages)
        if sent_with_extensions and reply.status in (400, 422) and _names_eos_extension(reply.error):
            if self.settings.ignore_eos:  # a concurrent request may have switched it off already
                self.settings.ignore_eos = False
                self.notes.append(
                    f"the server rejected ignore_eos/min_tokens (HTTP {reply.status}); requests were sent "
                    f"without them, so answers may be shorter than --output-tokens"
                )
            reply = await self._stream(messages)
        return reply

    async def _stream(self, messages: list[dict]) -> StreamedReply:
        payload = build_payload(self.target, self.settings, messages)
        reply = StreamedReply(sent_at=time.perf_counter())
        try:
            async with self.http.stream(
                "POST", self.target.url, json=payload, headers=self.target.headers
            ) as response:
                reply.status = response.status_code
                if response.status_code != 200:
                    body = (await response.aread()).decode("utf-8", errors="replace")
                    reply.error = f"HTTP {response.status_code}: {_snippet(body)}"
                else:
                    await self._read_events(response, reply)
        except httpx.ConnectError as exc:
            reply.error = f"unreachable: {self.target.url}: {exc}"
        except httpx.TimeoutException as exc:
            reply.error = f"timeout after {len(reply.token_times)} output chunks: {type(exc).__name__}"
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            where = "mid-stream" if reply.status is not None else "before the response"
            reply.error = f"connection cut {where} after {len(reply.token_times)} output chunks: {exc}"
        except httpx.HTTPError as exc:
            reply.error = f"{type(exc).__name__}: {exc}"
        reply.finished_at = time.perf_counter()
        return reply

    async def _read_events(self, response: httpx.Response, reply: StreamedReply) -> None:
        visible: list[str] = []
        everything: list[str] = []
        saw_done = saw_event = False
        async for line in response.aiter_lines():
            arrived = time.perf_counter()
            if not line.startswith("data:"):
                continue  # blank separators, SSE comments, `event:` lines
            saw_event = True
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                saw_done = True
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                chunk = None
            if not isinstance(chunk, dict):
                reply.error = (
                    f"malformed JSON chunk after {len(reply.token_times)} output chunks: {_snippet(data)}"
                )
                break
            if chunk.get("error"):
                reply.error = f"error event in stream: {_snippet(json.dumps(chunk['error']))}"
                break
            text, reasoning = _chunk_output(chunk, self.target.endpoint)
            if text or reasoning:
                reply.token_times.append(arrived)
                visible.append(text)
                everything.append(reasoning + text)
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                reply.usage_prompt_tokens = usage.get("prompt_tokens", reply.usage_prompt_tokens)
                reply.usage_completion_tokens = usage.get("completion_tokens", reply.usage_completion_tokens)
        reply.text = "".join(visible)
        reply.all_output_text = "".join(everything)
        if reply.error:
            return
        if not saw_event:
            content_type = response.headers.get("content-type", "none")
            reply.error = (
                f"no SSE events in the answer (Content-Type: {content_type}); does the server stream?"
            )
        elif not saw_done:
            reply.error = (
                f"truncated stream: ended without [DONE] after {len(reply.token_times)} output chunks"
            )
        elif not reply.token_times:
            reply.error = "stream finished without any output text"


def _names_eos_extension(error: str) -> bool:
    return any(name in error for name in EOS_EXTENSIONS)


def _snippet(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= BODY_SNIPPET_CHARS else flat[:BODY_SNIPPET_CHARS] + "..."


async def scrape_tierlm_metrics(http: httpx.AsyncClient, target: ServerTarget) -> dict[str, float] | None:
    """The `tierlm:` samples of `/metrics` as {"name{labels}": value}; None when the server has no
    such endpoint or is not tierlm (a benchmark of another server goes on without them)."""
    try:
        response = await http.get(target.server_root + "/metrics", headers=target.headers)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    samples: dict[str, float] = {}
    for line in response.text.splitlines():
        if not line.startswith("tierlm:"):
            continue  # comments, blank lines, other exporters' metrics
        labels_end = line.rfind("}")
        if labels_end >= 0:
            key, rest = line[: labels_end + 1], line[labels_end + 1 :]
        else:
            key, _, rest = line.partition(" ")
        try:
            samples[key] = float(rest.split()[0])
        except (IndexError, ValueError):
            continue  # a line this parser does not understand is not worth failing the benchmark
    return samples or None
