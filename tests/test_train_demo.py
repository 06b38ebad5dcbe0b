"""`tierlm train-demo` (tierlm/tools/train_demo) and the trained default model it made.

The training forward against the engine's prefill (fp32: the same logits, target and MTP draft, with QSA's
selection in play), gradients, the export round trip through tierlm's loader, the corpus split, the smoke
run end to end (its folder loads and generates past the QSA budget, MTP head included), and which model
`tierlm serve` picks without one. Then the committed default model (models/default_model; skipped until it
is committed): greedy `def fibonacci(n):` continues with a function body Python parses, and a json_schema
chat request ends with valid JSON within 64 tokens.
"""

from __future__ import annotations

import ast
import json
import math

import jsonschema
import pytest
import torch
import torch.nn.functional as F
from reference_models import BASE, BLOCK_SIZE, BLOCKS_PER_REQUEST, prompt_ids

from tierlm import LLM, SamplingParams
from tierlm.demo_model import TRAINED_DEFAULT_DIR, default_model_dir, train_tokenizer
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.loader import load_model
from tierlm.model.model_cache import ModelCache
from tierlm.sampling_params import StructuredOutputRequest
from tierlm.tools.train_demo.batched_forward import forward, indexer_distillation
from tierlm.tools.train_demo.corpus import collect_corpus, is_heldout, read_files
from tierlm.tools.train_demo.export import write_checkpoint
from tierlm.tools.train_demo.recipe import RECIPES, model_config
from tierlm.tools.train_demo.train import build_model, run_training

TOLERANCE = 1e-4  # fp32, as the model parity tests
WINDOWS, LENGTH = 3, 40  # LENGTH > budget + R - 1 = 11: the indexer's selection matters


@pytest.fixture(scope="module")
def dummy(tmp_path_factory):
    """The parity tests' fact-sheet config with an MTP head, random weights (`--load-format dummy`)."""
    folder = tmp_path_factory.mktemp("dummy")
    (folder / "config.json").write_text(json.dumps({**BASE, "mtp_num_hidden_layers": 1}))
    model, config = load_model(folder, dtype="float32", device="cpu", load_format="dummy", load_mtp=True)
    return model, config


def engine_prefill(model, config, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's logits for each window as one request's prefill [B, T, V], and its MTP draft's logits
    [B, T-1, V] (row t: token t+1 and the target's streams at t)."""
    batch_size, length = ids.shape
    cache = ModelCache(config, batch_size, batch_size * BLOCKS_PER_REQUEST, BLOCK_SIZE, torch.float32,
                       num_draft_layers=1)
    for slot in range(batch_size):
        cache.reset_slot(slot)
    tables = [list(range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST)) for i in range(batch_size)]
    slots = list(range(batch_size))
    starts = [0] * batch_size
    target = ForwardBatch.build([row.tolist() for row in ids], starts, slots, tables, BLOCK_SIZE, logits="all")
    logits, streams = model.forward_with_streams(target, cache)
    draft = ForwardBatch.build([row[1:].tolist() for row in ids], starts, slots, tables, BLOCK_SIZE, logits="all")
    hidden = streams.view(batch_size, length, -1)[:, :-1].flatten(0, 1)
    draft_logits, _ = model.draft(draft, hidden, cache)
    return logits.view(batch_size, length, -1), draft_logits.view(batch_size, length - 1, -1)


def test_training_forward_equals_the_engine_prefill(dummy):
    model, config = dummy
    ids = prompt_ids(config, WINDOWS, LENGTH, seed=3)  # EOS planted: the PLE context resets too
    expected, expected_draft = engine_prefill(model, config, ids)
    with torch.no_grad():
        out = forward(model, ids, with_draft=True)
        alone = forward(model, ids)
    assert (out.logits - expected).abs().max().item() <= TOLERANCE
    assert (out.draft_logits - expected_draft).abs().max().item() <= TOLERANCE
    assert alone.draft_logits is None and alone.indexer_loss is None and torch.equal(alone.logits, out.logits)


def test_gradients_reach_every_weight_and_the_indexers_only_through_their_loss(dummy):
    model, config = dummy
    ids = prompt_ids(config, 2, LENGTH, seed=4)
    indexers = {name for name, _ in model.named_parameters() if ".indexer." in name}

    def silent_after(objective) -> set[str]:
        model.zero_grad(set_to_none=True)
        out = forward(model, ids[:, :-1], with_draft=True, train_indexers=True)
        objective(out).backward()
        return {name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0}

    def language_model(out):
        loss = F.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten())
        return loss + F.cross_entropy(out.draft_logits.flatten(0, 1), ids[:, 2:].flatten())

    model.requires_grad_(True)
    try:
        # top-k passes no gradient: the language-model losses reach every weight but the indexers' ...
        assert silent_after(language_model) == indexers and indexers
        # ... and the distillation loss reaches the indexers' alone (the target and their input are detached)
        assert silent_after(lambda out: out.indexer_loss) == {n for n, _ in model.named_parameters()} - indexers
    finally:
        model.requires_grad_(False)
        model.zero_grad(set_to_none=True)


def test_indexer_distillation_is_zero_when_the_indexer_agrees_with_attention():
    """KL(p || softmax(scores)) over the visible blocks: 0 when the scores are log p (up to a constant),
    positive otherwise; queries that see no complete block do not count."""
    torch.manual_seed(0)
    batch, heads, length, dim, ratio = 2, 2, 12, 8, 4
    q, k = torch.randn(batch, heads, length, dim), torch.randn(batch, heads, length, dim)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    probs = (q @ k.transpose(-1, -2) / dim**0.5).masked_fill(~causal, float("-inf")).softmax(-1).mean(1)
    mass = probs.unflatten(-1, (length // ratio, ratio)).sum(-1)  # [B, T, G]
    visible = torch.arange(length // ratio) < ((torch.arange(length) + 1) // ratio)[:, None]
    agreeing = (mass.log() + 3.0).masked_fill(~visible, float("-inf"))
    assert indexer_distillation(agreeing, q, k, ratio, dim**-0.5).abs().item() < 1e-5
    flat = torch.zeros_like(mass).masked_fill(~visible, float("-inf"))
    assert indexer_distillation(flat, q, k, ratio, dim**-0.5).item() > 1e-3


def test_export_loads_back_into_the_same_model(tmp_path):
    recipe = RECIPES["smoke"]
    model = build_model(model_config(recipe, 512, 2), seed=1, device=torch.device("cpu"))
    write_checkpoint(model, model_config(recipe, 512, 2), train_tokenizer(512, 200_000), tmp_path, dtype=torch.float32)
    loaded, _ = load_model(tmp_path, dtype="float32", device="cpu", load_mtp=True)
    ids = torch.randint(7, 512, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = forward(model, ids, with_draft=True), forward(loaded, ids, with_draft=True)
    assert torch.equal(got.logits, expected.logits) and torch.equal(got.draft_logits, expected.draft_logits)


def test_corpus_split_dedupe_and_caps(tmp_path):
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    for i in range(60):
        (root / "pkg" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
    (root / "pkg" / "copy.py").write_text("def f0(x):\n    return x + 0\n")  # the same text as m0.py
    (root / "big.py").write_text("x = 1\n" * 40_000)  # over MAX_FILE_BYTES
    (root / "latin1.py").write_bytes(b"s = '\xe9'\n")  # not UTF-8
    (root / "data.py").write_text("X = [" + "1, " * 200 + "]\n")  # one long line: data, not code
    corpus = collect_corpus(10**6, 10**6, heldout_permille=200, roots=[root])
    texts = corpus.train + corpus.heldout
    assert len(texts) == len(set(texts)) == 60  # one of m0.py / copy.py, none of the rejected files
    assert all(is_heldout(p, 200) for p in corpus.heldout_paths)
    assert not any(is_heldout(p, 200) for p in corpus.train_paths)
    assert 0 < len(corpus.heldout) < len(corpus.train)
    capped = collect_corpus(100, 10**6, heldout_permille=200, roots=[root])
    assert 100 <= capped.train_bytes < 100 + 40 and capped.heldout == corpus.heldout
    assert read_files(corpus.heldout_paths + ["gone.py"], [root]) == (corpus.heldout, corpus.heldout_paths)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """The smoke recipe end to end, 2 steps (what `tierlm train-demo --size smoke --max-steps 2` runs)."""
    out = tmp_path_factory.mktemp("train") / "smoke"
    early = out.with_name("smoke-5pct")
    run = run_training(out, early, RECIPES["smoke"], 0, torch.device("cpu"), max_minutes=5, max_steps=2,
                       log=lambda line: None)
    return out, early, run


def test_smoke_run_writes_both_checkpoints_a_log_and_a_curve(smoke_run):
    out, early, _ = smoke_run
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 2 and log["tokens_seen"] == 2 * RECIPES["smoke"].batch_size * RECIPES["smoke"].seq_len
    assert log["stopped_by"] == "steps" and log["early"]["step"] == 1 and log["final"]["step"] == 2
    assert [point["step"] for point in log["heldout"]] == [0, 1, 2]
    assert all(math.isfinite(point["perplexity"]) for point in log["heldout"])
    assert log["corpus"]["train_tokens"] > 0 and log["corpus"]["heldout_paths"]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for folder in (out, early):
        names = {p.name for p in folder.iterdir()}
        assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                "model.safetensors"} <= names
        assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"


def test_smoke_model_generates_past_the_qsa_budget_with_its_mtp_head(smoke_run):
    out, _, _ = smoke_run
    config = json.loads((out / "config.json").read_text())
    budget, ratio = config["indexer_budget"], config["indexer_compress_ratio"]
    tokens = budget + ratio + 8  # the context outgrows the budget: the indexer selects
    plain = LLM(str(out), dtype="float32", device="cpu", max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    expected = plain.generate(["def fibonacci(n):"], greedy, use_tqdm=False)[0].outputs[0]
    assert len(expected.token_ids) == tokens
    speculative = LLM(str(out), dtype="float32", device="cpu", max_model_len=256,
                      speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    got = speculative.generate(["def fibonacci(n):"], greedy, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids  # greedy speculation keeps the target's tokens


def test_serve_without_a_model_picks_the_trained_default(tmp_path, monkeypatch):
    trained = tmp_path / "default_model"
    cached = tmp_path / "cache" / "tierlm" / "demo-tiny"
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")  # as built before: not rebuilt
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_model_dir(trained) == cached
    trained.mkdir()
    (trained / "config.json").write_text("{}")
    assert default_model_dir(trained) == trained


# ---- the committed default model ----------------------------------------------------------------------

needs_default = pytest.mark.skipif(not (TRAINED_DEFAULT_DIR / "config.json").exists(),
                                   reason="the trained default model is not committed yet (models/default_model)")


@pytest.fixture(scope="module")
def default_llm():
    return LLM(str(TRAINED_DEFAULT_DIR), dtype="float32", device="cpu", max_model_len=1024)


def complete_function(text: str) -> ast.FunctionDef | None:
    """The first function of the longest prefix of whole lines that Python parses, if it has a body."""
    lines = text.splitlines()
    for end in range(len(lines), 1, -1):
        try:
            module = ast.parse("\n".join(lines[:end]))
        except SyntaxError:
            continue
        functions = [node for node in module.body if isinstance(node, ast.FunctionDef)]
        if functions and functions[0].body:
            return functions[0]
    return None


@needs_default
def test_default_model_writes_a_fibonacci_body_python_parses(default_llm):
    prompt = "def fibonacci(n):"
    out = default_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=256), use_tqdm=False)[0]
    text = out.outputs[0].text
    body = [line for line in text.split("\n")[1:] if line.strip()]  # after the rest of the def line
    assert body and body[0].startswith((" ", "\t")), text  # the body is indented under the def
    function = complete_function(prompt + text)
    assert function is not None and function.name == "fibonacci", text


@needs_default
def test_default_model_answers_a_json_schema_request_within_64_tokens(default_llm):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    params = SamplingParams(temperature=0, max_tokens=64,
                            structured_output=StructuredOutputRequest(json_schema=json.dumps(schema)))
    messages = [{"role": "user", "content": "Give me a name and a number as JSON."}]
    completion = default_llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "stop", completion.text
    jsonschema.validate(json.loads(completion.text), schema)
