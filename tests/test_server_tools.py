"""Tools, reasoning, sampling fields and limits through `tierlm serve` with the openai SDK: one server
(--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3) on the random demo model."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from serve_process import serving

from tierlm.demo_model import build_demo_model
from tierlm.tokenizer import Tokenizer

MODEL = "demo-tiny"
MAX_REQUEST_BYTES = 1 << 16
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
THINKING = {"enable_thinking": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = build_demo_model(tmp_path_factory.mktemp("demo") / MODEL, "tiny")
    flags = [str(folder), "--dtype", "float32", "--device", "cpu", "--max-model-len", "1024", "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--max-n", "4",
             "--max-request-bytes", str(MAX_REQUEST_BYTES)]
    with serving(flags, tmp_path_factory.mktemp("log") / "server.log") as process:
        yield {"url": process.url, "model_dir": folder, "pid": process.pid}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key="none", max_retries=0, timeout=60)


def _valid_call(call, tool) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_required_tool_call_whole_and_streamed_through_the_sdk(client):
    kwargs = {"model": MODEL, "messages": ASK, "tools": [WEATHER, CLOCK], "tool_choice": "required",
                  "parallel_tool_calls": False, "max_tokens": 150, "temperature": 1.0, "seed": 4}
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    _valid_call(call, WEATHER if call.function.name == "get_weather" else CLOCK)
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (call.function.name, call.function.arguments)]


def test_a_named_function_is_called_by_every_choice(client):
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], n=3, temperature=1.0, seed=0, max_tokens=150,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        [call] = choice.message.tool_calls
        _valid_call(call, CLOCK)


def test_a_tool_round_trip_reaches_the_template(server, client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=150, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=4,
                                            temperature=0)
    tokenizer = Tokenizer.from_pretrained(server["model_dir"])
    rendered = tokenizer.apply_chat_template(
        [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
         {"role": "tool", "content": "sunny, 21 C"}], tools=[WEATHER])
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered and call.function.name in rendered
    assert answer.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


def test_reasoning_is_split_whole_and_streamed(client):
    kwargs = {"model": MODEL, "messages": ASK, "max_tokens": 30, "temperature": 1.0, "seed": 9, "logit_bias": {"4": 3.0},
                  "extra_body": {"chat_template_kwargs": THINKING, "top_k": 0}}  # 4: </think>, 16th here
    message = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.content and "</think>" not in reasoning
    chunks = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in chunks) == reasoning
    assert "".join(d.content or "" for d in chunks) == message.content
    closed = client.chat.completions.create(**{**kwargs, "extra_body": {"chat_template_kwargs": {
        "enable_thinking": False}, "top_k": 0}}).choices[0].message
    assert closed.model_extra.get("reasoning_content") is None and closed.content


def test_json_schema_applies_after_the_reasoning(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    message = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=150, temperature=1.0, seed=1, logit_bias={"4": 3.0},
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        extra_body={"chat_template_kwargs": THINKING, "top_k": 0},
    ).choices[0].message
    assert message.model_extra["reasoning_content"].strip()  # free text first
    jsonschema.validate(json.loads(message.content), schema)


def test_sampling_fields_reach_the_engine(client):
    kwargs = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 40, "temperature": 0, "logprobs": 0,
                  "extra_body": {"ignore_eos": True}}
    forced = client.completions.create(**{**kwargs, "max_tokens": 5}, logit_bias={"1234": 100})
    assert len(set(forced.choices[0].logprobs.tokens)) == 1
    plain = client.completions.create(**kwargs).choices[0].logprobs.tokens
    penalized = client.completions.create(frequency_penalty=2.0, **kwargs).choices[0].logprobs.tokens
    assert len(set(plain)) < len(plain) and len(set(penalized)) == len(penalized)


REFUSED = [("best_of", 3, "/v1/completions"), ("use_beam_search", True, "/v1/completions"),
           ("suffix", "end", "/v1/completions"), ("guided_json", {"type": "object"}, "/v1/chat/completions"),
           ("echo", True, "/v1/chat/completions"), ("reasoning_effort", "high", "/v1/chat/completions"),
           ("prompt_logprobs", 1, "/v1/chat/completions")]


@pytest.mark.parametrize(("field", "value", "path"), REFUSED)
def test_fields_tierlm_does_not_implement_are_refused(server, field, value, path):
    body = {"model": MODEL, "max_tokens": 1, field: value}
    body.update({"messages": ASK} if "chat" in path else {"prompt": "x"})
    response = httpx.post(f"{server['url']}{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field and field in response.json()["error"]["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"n": 5}, "n"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
])
def test_tool_and_limit_errors_name_their_parameter(server, body, param):
    response = httpx.post(f"{server['url']}/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_routes_limits_and_errors_in_openai_shape(server, client):
    url = server["url"]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    assert httpx.get(f"{url}/version").json()["version"]
    schemas = httpx.get(f"{url}/openapi.json").json()["components"]["schemas"]
    assert {"tools", "tool_choice", "logit_bias"} <= set(schemas["ChatCompletionRequest"]["properties"])
    # the schema allows only what this server serves: n up to --max-n 4, token ids in the vocabulary,
    # top_logprobs only with logprobs, tool_choice required / named only with tools
    assert [schemas[m]["properties"]["n"]["maximum"] for m in ("CompletionRequest", "ChatCompletionRequest")] == [4, 4]
    vocab = Tokenizer.from_pretrained(server["model_dir"]).vocab_size
    assert schemas["CompletionRequest"]["properties"]["prompt"]["oneOf"][2]["items"] == {
        "type": "integer", "minimum": 0, "maximum": vocab - 1}
    assert "x-tierlm-token-id" not in json.dumps(schemas)
    assert "maximum" not in schemas["CompletionRequest"]["properties"]["stop_token_ids"]["anyOf"][0]["items"]
    assert schemas["CompletionRequest"]["properties"]["logit_bias"]["anyOf"][0]["additionalProperties"] is False
    assert schemas["ChatCompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 1023  # --max-model-len
    rules = schemas["ChatCompletionRequest"]["allOf"]
    assert [rule["then"]["required"] for rule in rules] == [["logprobs"], ["tools"]]  # auto tool choice is on
    cases = [(httpx.get(f"{url}/v1/nothing"), 404), (httpx.get(f"{url}/v1/chat/completions"), 405),
             (httpx.post(f"{url}/v1/completions", content=b"x" * (MAX_REQUEST_BYTES + 1)), 413)]
    for response, status in cases:
        assert response.status_code == status
        assert response.json()["error"]["code"] == status and response.json()["error"]["message"]


@pytest.mark.parametrize(("body", "rendered"), [
    ({"tools": [CLOCK]}, '"auto"|True'),
    ({"tools": [CLOCK], "tool_choice": "required", "parallel_tool_calls": False}, '"required"|False'),
    ({"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     '{"function": {"name": "get_time"}, "type": "function"}|True'),
    ({}, '"none"|True'),
    ({"tools": [CLOCK], "chat_template_kwargs": {"tool_choice": "mine"}}, '"mine"|True'),  # the kwargs win
])
def test_tool_choice_and_parallel_tool_calls_reach_the_template(body, rendered):
    from types import SimpleNamespace

    import tokenizers

    from tierlm.server.chat import _render, _tool_choice
    from tierlm.server.protocol import ChatCompletionRequest

    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    template = "{{ tool_choice | tojson(sort_keys=True) }}|{{ parallel_tool_calls }}"
    ctx = SimpleNamespace(tokenizer=Tokenizer(backend, chat_template=template), max_model_len=64,
                          auto_tool_choice=True)
    request = ChatCompletionRequest.model_validate({"model": MODEL, "messages": ASK, **body})
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    assert _render(ctx, request, tools, _tool_choice(request, ctx, tools))[0] == rendered


def _rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))


def _metric(url: str, *names: str) -> float:
    """The sum of these metrics over their labels, from /metrics."""
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(tuple(n + "{" for n in names)))


def test_short_load_leaves_health_answering_and_the_engine_empty(server):
    """bench/server_load.py scaled down: 6 streams (3 cut after 1-2 chunks) and bodies near
    --max-request-bytes at once; every /health answers 200 (each within 10 s: the machine may be loaded),
    every uncut stream ends with [DONE], and afterwards the engine holds no request (the cut ones, long, were
    aborted: they never finish) and RSS has not run off."""
    url = server["url"]
    rss_before = _rss_bytes(server["pid"])
    finished_before = _metric(url, "tierlm:request_success_total")

    async def stream(client: httpx.AsyncClient, cut_after: int | None) -> bool:
        max_tokens = 12 if cut_after is None else 900
        body = {"model": MODEL, "messages": ASK, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        chunks = 0
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    return True
                chunks += line.startswith("data: ")
                if cut_after is not None and chunks >= cut_after:
                    return True  # leaving the block closes the connection mid-stream
        return False

    async def big(client: httpx.AsyncClient, size: int) -> int:
        prompt = "word " * (size // 5)
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
        return (await client.post("/v1/completions", content=body + b" " * (size - len(body)))).status_code

    async def load() -> tuple[list[int], list[bool], list[int]]:
        health: list[int] = []
        done = asyncio.Event()

        async def probe(client: httpx.AsyncClient) -> None:
            while not done.is_set():
                health.append((await client.get("/health", timeout=10)).status_code)
                await asyncio.sleep(0.05)

        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            probing = asyncio.create_task(probe(client))
            cuts = [None, 1, None, 2, None, 1]
            results = await asyncio.gather(*(stream(client, cut) for cut in cuts),
                                           big(client, MAX_REQUEST_BYTES - 512), big(client, MAX_REQUEST_BYTES + 1))
            done.set()
            await probing
        return health, [ok for ok, cut in zip(results[:6], cuts, strict=True) if cut is None], list(results[6:])

    health, uncut, big_statuses = asyncio.run(load())
    assert health and set(health) == {200}
    assert uncut == [True, True, True]
    assert big_statuses == [400, 413]  # too long for the context (tokenized off the loop); over the body limit
    in_engine = ("tierlm:num_requests_running", "tierlm:num_requests_waiting")
    deadline = time.monotonic() + 60  # the cut streams' aborts reach the engine thread
    while _metric(url, *in_engine) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(url, *in_engine) == 0
    assert _metric(url, "tierlm:request_success_total") - finished_before == len(uncut)
    assert _rss_bytes(server["pid"]) < rss_before * 1.5 + (256 << 20)
