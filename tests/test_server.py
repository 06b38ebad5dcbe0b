"""`tierlm serve` as a subprocess on the demo model, driven by the official openai client and httpx.

One server per module, on the random tiny demo model built into a tmp dir (`tierlm serve` without MODEL
serves the trained default instead: tests/test_train_demo.py); the offline `LLM` on the same folder is the
reference for greedy outputs.
"""

from __future__ import annotations

import functools
import json
import math
import operator
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from serve_process import serving

from tierlm import LLM, SamplingParams
from tierlm.demo_model import build_demo_model

API_KEY = "sk-tierlm-test"
MODEL = "demo-tiny"
MAX_MODEL_LEN = 512
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    folder = build_demo_model(cache / MODEL, "tiny")
    flags = [str(folder), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4", "--dtype", "float32",
             "--device", "cpu", "--api-key", API_KEY]
    with serving(flags, cache / "server.log") as process:
        yield {"url": process.url, "model_dir": folder}


@pytest.fixture(scope="module")
def llm(server):
    folder = str(server["model_dir"])
    return LLM(folder, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN, max_num_seqs=4)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def post(server, path: str, body, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(f"{server['url']}{path}", content=content, headers=headers, timeout=timeout)


def metrics(server) -> dict[str, float]:
    """{'name{labels}': value} of the /metrics page."""
    text = httpx.get(f"{server['url']}/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def metric(server, name: str) -> float:
    """The sum of a metric's series."""
    return sum(v for k, v in metrics(server).items() if re.fullmatch(rf"{re.escape(name)}(\{{.*\}})?", k))


def offline(llm, prompt: str, max_tokens: int, **params):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
    return llm.generate(prompt, params)[0]


# ---- basics -------------------------------------------------------------------------------------------


def test_models_health_and_served_name(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server['url']}/health").status_code == 200


def test_completion_equals_offline_greedy(client, llm):
    prompt = "def fibonacci(n):"
    reference = offline(llm, prompt, 12, logprobs=0).outputs[0]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, logprobs=0, **GREEDY)
    choice = response.choices[0]
    assert choice.text == reference.text
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 12
    assert response.usage.prompt_tokens == len(llm.get_tokenizer().encode(prompt))
    expected = [entry[t].logprob for t, entry in zip(reference.token_ids, reference.logprobs, strict=True)]
    assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)


def test_streamed_completion_equals_whole(client):
    kwargs = dict(model=MODEL, prompt="import os\nimport sys\n", max_tokens=16, **GREEDY)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_equals_offline_chat(client, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a sort."}]
    reference = llm.chat(messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, **GREEDY
    )
    assert response.choices[0].message.content == reference.outputs[0].text
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == len(reference.prompt_token_ids)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, stream=True, stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference.outputs[0].text
    assert chunks[-1].usage.completion_tokens == 10


def test_sampling_options_reach_the_engine(client, llm):
    # n with a seed: reproducible; a stop string cuts the text; min_tokens holds back EOS
    kwargs = {"model": MODEL, "prompt": "class Parser:", "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 5}
    first = [c.text for c in client.completions.create(**kwargs).choices]
    assert first == [c.text for c in client.completions.create(**kwargs).choices] and len(first) == 3
    text = offline(llm, "x = 1", 20).outputs[0].text
    stop = text[5:8]
    cut = client.completions.create(model=MODEL, prompt="x = 1", max_tokens=20, stop=[stop], **GREEDY)
    cut = cut.choices[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, logprobs=True,
        top_logprobs=3, top_p=0.9, temperature=0.5, seed=1, extra_body={"min_tokens": 6, "top_k": 20},
    ).choices[0]
    assert chat.finish_reason == "length" and len(chat.logprobs.content) == 6
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.top_logprobs[2].logprob
               for t in chat.logprobs.content)


def test_prompt_forms(client, llm):
    ids = llm.get_tokenizer().encode("def add(a, b):")
    texts = [offline(llm, p, 5).outputs[0].text for p in ("def add(a, b):", "x")]
    response = client.completions.create(model=MODEL, prompt=["def add(a, b):", "x"], max_tokens=5, **GREEDY)
    assert [c.text for c in response.choices] == texts and [c.index for c in response.choices] == [0, 1]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, **GREEDY)
    assert by_ids.choices[0].text == texts[0]


def test_concurrent_greedy_requests_equal_each_alone(client, llm):
    prompts = ["def f(x):", "import json", "class A:\n    pass\n", "for i in range(10):", "# comment",
               "x = [", "while True:", "print('hello')"]
    lengths = [4, 9, 14, 19, 24, 29, 34, 40]
    alone = [offline(llm, p, n).outputs[0].text for p, n in zip(prompts, lengths, strict=True)]

    def ask(i: int) -> str:
        response = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=lengths[i], **GREEDY)
        return response.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, range(8)))
    assert together == alone


# ---- scoring (lm-eval-harness loglikelihood) -------------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_equal_offline_prompt_logprobs(server, llm, max_tokens):
    prompt = "def fibonacci(n):\n    return n"
    reference = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    response = post(server, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": 1,
        "temperature": 0,
    })
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    num_prompt = len(reference.prompt_token_ids)
    assert len(logprobs["tokens"]) == num_prompt + max_tokens
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    scored = zip(reference.prompt_token_ids[1:], reference.prompt_logprobs[1:], strict=True)
    expected = [entry[token].logprob for token, entry in scored]
    assert logprobs["token_logprobs"][1:num_prompt] == pytest.approx(expected, abs=1e-4)
    assert choice["text"] == prompt + (reference.outputs[0].text if max_tokens else "")
    assert "".join(logprobs["tokens"][:num_prompt]) == prompt
    tokens = logprobs["tokens"]
    assert logprobs["text_offset"][:3] == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]
    assert response.json()["usage"]["completion_tokens"] == max_tokens


def test_streamed_echo_puts_the_prompt_first(server):
    body = {"model": MODEL, "prompt": "import os", "max_tokens": 3, "echo": True, "logprobs": 0, "temperature": 0,
            "stream": True}
    whole = post(server, "/v1/completions", {**body, "stream": False}).json()["choices"][0]
    lines = post(server, "/v1/completions", body).text.split("\n\n")
    assert lines[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(line.removeprefix("data: "))["choices"][0] for line in lines[:-2]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert functools.reduce(operator.iadd, (c["logprobs"]["token_logprobs"] for c in chunks), []) == whole["logprobs"]["token_logprobs"]
    assert functools.reduce(operator.iadd, (c["logprobs"]["text_offset"] for c in chunks), []) == whole["logprobs"]["text_offset"]


# ---- structured output ------------------------------------------------------------------------------

SCHEMAS = {
    "required_fields": {
        "type": "object", "required": ["name", "age"],
        "properties": {"name": {"type": "string", "maxLength": 8},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    },
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
             "required": ["color"]},
    "int_array": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50},
                  "minItems": 1, "maxItems": 4},
    "nested": {
        "type": "object", "required": ["user", "ok"],
        "properties": {
            "user": {"type": "object", "required": ["id", "tags"], "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 999},
                "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"},
                         "maxItems": 3},
            }},
            "ok": {"type": "boolean"},
        },
    },
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(client, name, stream):
    response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}
    messages = [{"role": "user", "content": f"Give me {name} as JSON."}]
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": 120, "temperature": 0,
                  "response_format": response_format}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        text, finish = choice.message.content, choice.finish_reason
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_schema_on_completions_with_sampling(client):
    response = client.completions.create(
        model=MODEL, prompt="data:", max_tokens=120, n=3, temperature=1.0, seed=3,
        extra_body={"response_format": {
            "type": "json_schema", "json_schema": {"name": "e", "schema": SCHEMAS["nested"]},
        }},
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), SCHEMAS["nested"])


def test_json_object_output_parses(client):
    # free-form keys from random weights may not close within the budget; the ones that stop must parse
    response = client.completions.create(
        model=MODEL, prompt="def f(x):", max_tokens=40, n=8, temperature=1.0, seed=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    stopped = [c.text for c in response.choices if c.finish_reason == "stop"]
    assert stopped
    assert all(isinstance(json.loads(text), dict) for text in stopped)
    assert all(c.text.startswith("{") for c in response.choices)


# ---- disconnects --------------------------------------------------------------------------------------


def _wait_idle(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(server, "tierlm:num_requests_running") or metric(server, "tierlm:num_requests_waiting"):
        assert time.monotonic() < deadline, "the aborted request still holds its place in the engine"
        time.sleep(0.05)


def test_client_disconnect_mid_stream_frees_the_request(server):
    _wait_idle(server)
    succeeded = metric(server, "tierlm:request_success_total")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 450, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server['url']}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as response:
        events = response.iter_lines()
        assert next(e for e in events if e.startswith("data:"))
        deadline = time.monotonic() + 2  # the gauges of a busy engine are up to STATS_INTERVAL_S old
        while metric(server, "tierlm:num_requests_running") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    _wait_idle(server, timeout=5)
    generated = metric(server, "tierlm:generation_tokens_total")
    time.sleep(0.3)
    assert metric(server, "tierlm:generation_tokens_total") == generated  # nothing runs for it any more
    assert metric(server, "tierlm:request_success_total") == succeeded


def test_client_disconnect_while_waiting_for_a_whole_answer(server):
    _wait_idle(server)
    succeeded = metric(server, "tierlm:request_success_total")
    body = {"model": MODEL, "prompt": "y", "max_tokens": 450, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", body, timeout=0.5)
    _wait_idle(server, timeout=5)
    assert metric(server, "tierlm:request_success_total") == succeeded


# ---- errors -------------------------------------------------------------------------------------------

LONG_PROMPT = "word " * MAX_MODEL_LEN
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_REQUESTS = {
    "prompt_too_long": ("/v1/completions", {"model": MODEL, "prompt": LONG_PROMPT}, "prompt",
                        "max_model_len"),
    "max_tokens_past_context": ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "max_tokens",
                                "max_model_len"),
    "temperature": ("/v1/chat/completions", {**CHAT, "temperature": -1}, "temperature", "temperature"),
    "top_p": ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p", "top_p"),
    "n": ("/v1/completions", {"prompt": "x", "n": 0}, "n", "n: Input should be greater than or equal to 1"),
    "temperature_above_openai_range": ("/v1/completions", {"prompt": "x", "temperature": 2.5}, "temperature",
                                       "less than or equal to 2"),
    "nan_literal": ("/v1/completions", '{"prompt": "x", "temperature": NaN}', "temperature", "finite number"),
    "seed_beyond_64_bits": ("/v1/completions", {"prompt": "x", "seed": 2**70}, "seed", "seed"),
    "stream_is_not_a_boolean": ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream", "boolean"),
    "max_tokens_as_a_string": ("/v1/completions", {"prompt": "x", "max_tokens": "3"}, "max_tokens",
                               "valid integer"),
    "booleans_as_token_ids": ("/v1/completions", {"prompt": [[True, False]]}, "prompt", "valid integer"),
    "stop_token_id_negative": ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids",
                               "greater than or equal to 0"),
    "logprobs": ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs", "logprobs"),
    "malformed_json": ("/v1/chat/completions", '{"messages": [', None, "not valid JSON"),
    "not_an_object": ("/v1/completions", "[1, 2]", None, "JSON object"),
    "bad_schema": ("/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
            "a": {"type": "nonsense"}}}}}}, "response_format", "json_schema"),
    "unsupported_schema_ref": ("/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
            "a": {"$ref": "#/missing"}}}}}}, "response_format", "json_schema"),
    "missing_messages": ("/v1/chat/completions", {"model": MODEL}, "messages", "messages"),
    "missing_prompt": ("/v1/completions", {"model": MODEL, "max_tokens": 3}, "prompt", "prompt"),
    "empty_messages": ("/v1/chat/completions", {**CHAT, "messages": []}, "messages", "messages"),
    "wrong_type": ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens", "max_tokens"),
    "empty_prompt": ("/v1/completions", {"prompt": ""}, "prompt", "at least 1 character"),
    "empty_token_list": ("/v1/completions", {"prompt": [[1], []]}, "prompt", "at least 1 item"),
    "content_missing": ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, "messages",
                        "content: Field required"),
    "json_schema_format_without_schema": ("/v1/completions", {"prompt": "x", "response_format": {
        "type": "json_schema"}}, "response_format", "json_schema: Field required"),
    "reserved_template_kwarg": ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"messages": []}},
                                "chat_template_kwargs", "cannot be set there"),
    "token_outside_vocab": ("/v1/completions", {"prompt": [1, 10**9]}, "prompt", "vocabulary"),
    "tools_without_auto_tool_choice": ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f"}}]}, "tool_choice", "--enable-auto-tool-choice"),
    "image_without_vision_tower": ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "messages[0].content[0]",
        "has no vision tower"),
    "unknown_role": ("/v1/chat/completions", {
        **CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages", "'robot'"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_requests_get_400_in_openai_shape(server, case):
    path, body, param, words = BAD_REQUESTS[case]
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["param"] == param
    assert words in error["message"]


def test_bad_requests_reach_the_openai_client_as_errors(client):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=MODEL, prompt="x", top_p=7)
    with pytest.raises(openai.NotFoundError, match="gpt-17"):  # OpenAI and vLLM answer 404 too
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions")]:
            response = httpx.request(method, f"{server['url']}{path}", headers=headers, json={"prompt": "x"})
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(f"{server['url']}/health").status_code == 200
    assert httpx.get(f"{server['url']}/metrics").status_code == 200


def test_serves_normally_after_errors(server, client):
    for case in ("prompt_too_long", "bad_schema", "malformed_json"):
        path, body, _, _ = BAD_REQUESTS[case]
        assert post(server, path, body).status_code == 400
    messages = [{"role": "user", "content": "hi"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    assert response.choices[0].finish_reason in ("length", "stop")


# ---- metrics ------------------------------------------------------------------------------------------

METRIC_NAMES = [
    "tierlm:time_to_first_token_seconds_count", "tierlm:inter_token_latency_seconds_count",
    "tierlm:e2e_request_latency_seconds_count", "tierlm:prompt_tokens_total",
    "tierlm:generation_tokens_total",
    "tierlm:num_preemptions_total", "tierlm:request_success_total", "tierlm:num_requests_running",
    "tierlm:num_requests_waiting", "tierlm:kv_cache_usage_perc", "tierlm:prefix_cache_queries_total",
    "tierlm:prefix_cache_hits_total", "tierlm:device_memory_allocated_bytes", "tierlm:device_memory_peak_bytes",
    "tierlm:num_streams_throttled", "tierlm:streams_ended_stalled_total",
    "tierlm:spec_decode_num_drafts_total", "tierlm:spec_decode_num_draft_tokens_total",
    "tierlm:spec_decode_num_accepted_tokens_total",
]


def test_metrics_names_and_counts(server, client):
    before = metrics(server)
    names = {key.split("{")[0] for key in before}
    assert not [name for name in METRIC_NAMES if name not in names]
    ttft = metric(server, "tierlm:time_to_first_token_seconds_count")
    prompt_tokens = metric(server, "tierlm:prompt_tokens_total")
    client.completions.create(model=MODEL, prompt="abc", max_tokens=3, **GREEDY)
    client.completions.create(model=MODEL, prompt="abc", max_tokens=3, **GREEDY)
    assert metric(server, "tierlm:time_to_first_token_seconds_count") == ttft + 2
    assert metric(server, "tierlm:prompt_tokens_total") > prompt_tokens
    assert metric(server, "tierlm:request_success_total") >= 2
    assert 'finished_reason="length"' in httpx.get(f"{server['url']}/metrics").text
    assert math.isfinite(metric(server, "tierlm:e2e_request_latency_seconds_sum"))


def test_tierlm_bench_end_to_end(server, tmp_path):
    """`tierlm bench` (client side) against this server: chat, 2 streams, 2 turns, metrics snapshots."""
    from tierlm.cli import main

    result = tmp_path / "result.json"
    code = main([
        "bench", "--base-url", server["url"], "--model", MODEL, "--api-key", API_KEY, "--concurrency", "2",
        "--num-requests", "2", "--turns", "2", "--prompt-tokens", "24", "--output-tokens", "8", "--warmup", "0",
        "--lane", "cold", "--state-file", str(tmp_path / "state.json"),
        "--tokenizer", str(server["model_dir"] / "tokenizer.json"), "--no-progress", "--result-json", str(result),
    ])
    assert code == 0
    data = json.loads(result.read_text())
    assert data["completed"] == 4 and data["failed"] == 0
    assert data["output_lens"] == [8, 8, 8, 8]  # usage from the server: ignore_eos + max_tokens honoured
    assert all(ttft > 0 for ttft in data["ttfts"]) and len(data["turn_ttfts_ms"]) == 2
    before, after = data["server_metrics_before"], data["server_metrics_after"]
    generated = [k for k in after if k.startswith("tierlm:generation_tokens_total")]
    assert generated and after[generated[0]] - before.get(generated[0], 0) >= 32
