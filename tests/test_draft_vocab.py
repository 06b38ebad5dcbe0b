"""A reduced draft vocabulary (FR-Spec; SGLang's speculative token map): a layer's output rows cut in its
own format (`Linear.output_rows`), the MTP head's logits from those rows only (`MultiTokenPredictor.
restrict_vocab`), the map file read and refused with clear errors, `tierlm draft-vocab` and the plan's bytes.
The engine's tokens with a map are in tests/test_speculative.py."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tierlm.cli import main as cli_main
from tierlm.demo_model import build_demo_model
from tierlm.engine.sampling_pass import sampling_probs
from tierlm.engine.speculative import SpeculativeConfig
from tierlm.model.layers.packed_linear import Linear
from tierlm.model.loader import load_model
from tierlm.model.mtp import NOT_DRAFTED
from tierlm.model.quantization.base import DENSE
from tierlm.model.quantization.compressed_tensors import PackQuantizedFormat
from tierlm.model.quantization.gptq import GptqFormat
from tierlm.sampling_params import SamplingParams
from tierlm.tools.draft_vocab import draft_vocab

FORMATS = {"dense": DENSE, "int4-g32": PackQuantizedFormat(4, 32), "int8-channel": PackQuantizedFormat(8, None),
           "gptq-int4-asym-g_idx": GptqFormat(4, 32, False, True)}


def random_layer(fmt, n: int, k: int, seed: int) -> Linear:
    """A Linear [n, k] in `fmt` with random runtime tensors (any bit pattern is a valid packed word)."""
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(k, n, decode_gemv=False)
    layer.set_format(fmt)
    for name, spec in fmt.runtime_tensors(n, k).items():
        shape = spec.shape
        if spec.dtype is None:
            value = torch.randn(shape, generator=gen) * 0.05
        elif name == "g_idx":
            value = torch.randint(0, k // 32, shape, generator=gen, dtype=torch.int32)
        elif spec.dtype == torch.uint8:
            value = torch.randint(0, 16, shape, generator=gen, dtype=torch.uint8)
        else:
            value = torch.randint(-(1 << 31), (1 << 31) - 1, shape, generator=gen, dtype=spec.dtype)
        setattr(layer, name, torch.nn.Parameter(value, requires_grad=False))
    return layer


@pytest.mark.parametrize("name", list(FORMATS))
def test_output_rows_are_the_layers_rows_in_its_format(name):
    fmt = FORMATS[name]
    full = random_layer(fmt, 96, 128, seed=len(name))
    rows = torch.tensor([90, 3, 17, 0, 64, 33, 95])
    part = full.output_rows(rows)
    assert part.quant_method.format == fmt and (part.in_features, part.out_features) == (128, 7)
    stored = sum(t.numel() * t.element_size() for t in part.parameters())
    assert stored < sum(t.numel() * t.element_size() for t in full.parameters()) / 4  # packed, not dequantized
    weight = full.quant_method.dequantized_weight(full, torch.float32)
    assert torch.equal(part.quant_method.dequantized_weight(part, torch.float32), weight[rows])
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(part(x), full(x)[:, rows], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("vocab") / "demo", "tiny", mtp=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_restricted_draft_logits_keep_the_maps_tokens_alone(demo, dtype):
    """The head's logits at the map's tokens (from the copied rows, in the model dtype: the same products as
    the full head's), NOT_DRAFTED elsewhere; the argmax is the best drafted token."""
    model, config = load_model(demo, dtype, "cpu", load_mtp=True)
    x = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    full = model.mtp.logits(model.lm_head, x)
    ids = torch.tensor([7, 1, config.vocab_size - 1, 250, 42])
    model.mtp.restrict_vocab(ids, model.lm_head)
    cut = model.mtp.logits(model.lm_head, x)
    assert cut.shape == full.shape and cut.dtype == dtype
    tolerance = {} if dtype == torch.float32 else {"rtol": 0.0, "atol": 0.0}  # bf16: the same rounded products
    torch.testing.assert_close(cut[:, ids].float(), full[:, ids].float(), **tolerance)
    outside = torch.ones(config.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert (cut[:, outside] == torch.tensor(NOT_DRAFTED, dtype=dtype)).all()
    assert torch.equal(cut.argmax(dim=-1), ids[full[:, ids].argmax(dim=-1)])


def test_a_row_whose_drafted_tokens_are_all_masked_still_samples(demo):
    """A grammar that forbids every token of the map leaves the others at NOT_DRAFTED, finite: the draft
    distribution is then uniform over the tokens the grammar allows (not NaN), even at a low temperature."""
    from tierlm.engine.request import Request

    model, config = load_model(demo, "float32", "cpu", load_mtp=True)
    ids = torch.arange(0, 64)
    model.mtp.restrict_vocab(ids, model.lm_head)
    logits = model.mtp.logits(model.lm_head, torch.randn(1, config.hidden_size))
    allowed = torch.tensor([100, 200, 300])
    masked = torch.full_like(logits, float("-inf"))
    masked[:, allowed] = logits[:, allowed]
    request = Request("r", [1], SamplingParams(temperature=0.05, top_k=-1, top_p=0.9, min_p=0.0), frozenset(), 100)
    probs = sampling_probs(masked, [request])[0]
    assert torch.isfinite(probs).all() and probs.sum().item() == pytest.approx(1.0)
    assert torch.allclose(probs[allowed], torch.full((3,), 1 / 3))


@pytest.mark.parametrize("ids, message", [
    ([], "non-empty"), ([5, 5], "more than once"), ([-1, 3], "token id -1 is outside"),
    ([3, 10**6], "token id 1000000 is outside"),
])
def test_bad_maps_are_refused_with_the_reason(demo, ids, message):
    model, _ = load_model(demo, "float32", "cpu", load_mtp=True)
    with pytest.raises(ValueError, match=message):
        model.mtp.restrict_vocab(torch.tensor(ids, dtype=torch.int64), model.lm_head)
    assert model.mtp.draft_head is None


def test_map_files_are_read_or_refused(tmp_path):
    listed = tmp_path / "map.json"
    listed.write_text(json.dumps([4, 9, 2]))
    saved = tmp_path / "map.pt"
    torch.save(torch.tensor([4, 9, 2]), saved)
    for path in (listed, saved):
        config = SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 1,
                                          "speculative_token_map": str(path)})
        assert config.draft_token_ids == (4, 9, 2)
    bad = {"missing.json": None, "floats.json": "[1.5, 2]", "object.json": '{"ids": [1]}', "text.json": "1 2 3"}
    for name, text in bad.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=f"speculative_token_map {re.escape(str(tmp_path / name))}"):
            SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 1,
                                     "speculative_token_map": str(tmp_path / name)})
    with pytest.raises(ValueError, match="must be a file path"):
        SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 1, "speculative_token_map": 3})


def test_draft_vocab_puts_the_stop_tokens_first_then_the_most_frequent():
    counts = torch.tensor([5, 0, 9, 9, 1, 7]).numpy()
    assert draft_vocab(counts, 3, always=[1]) == [1, 2, 3]  # 1 (a stop token), then 9, 9 (ties: lower id)
    assert draft_vocab(counts, 4, always=[4, 4, 99]) == [2, 3, 4, 5]  # out-of-vocabulary and repeats dropped
    with pytest.raises(ValueError, match="at least 1"):
        draft_vocab(counts, 0, always=[])


def test_the_cli_writes_a_map_with_its_stop_tokens_and_coverage(demo, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat; the dog sat on the log.\n" * 20)
    out = tmp_path / "map.json"
    assert cli_main(["draft-vocab", str(demo), "--text", str(text), "--size", "40", "--out", str(out)]) == 0
    ids = json.loads(out.read_text())
    assert len(ids) == len(set(ids)) == 40 and ids == sorted(ids)
    from tierlm.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(demo)
    assert set(tokenizer.eos_token_ids) <= set(ids)
    assert set(tokenizer.encode("the cat sat on the mat", add_special_tokens=False)) <= set(ids)
    assert re.search(r"40 of [\d,]+ token ids; they cover .* \(100\.00%\)", capsys.readouterr().out)
    assert cli_main(["draft-vocab", str(demo), "--text", str(text), "--size", "0", "--out", str(out)]) == 2
    assert "--size must be between 1" in capsys.readouterr().err


def test_the_plan_counts_the_maps_head(demo, tmp_path, capsys):
    """`tierlm plan` with a map: the draft head's copied rows (R of the tied head's V rows) on top."""
    from tierlm.config import ModelConfig

    config = ModelConfig.from_pretrained(demo)
    token_map = tmp_path / "map.json"
    token_map.write_text(json.dumps(list(range(100))))

    def planned(speculative: dict) -> int:
        assert cli_main(["plan", str(demo), "--kv-cache-memory-bytes", str(32 << 20), "--speculative-config",
                         json.dumps(speculative)]) == 0
        return int(re.search(r"\(([\d,]+) B of weights", capsys.readouterr().out).group(1).replace(",", ""))

    base = {"method": "mtp", "num_speculative_tokens": 1}
    extra = planned({**base, "speculative_token_map": str(token_map)}) - planned(base)
    assert extra == 100 * config.hidden_size * 4  # fp32 rows of the head


def test_a_map_over_a_packed_int8_head_keeps_the_tokens(tmp_path):
    """int4-mixed holds the (tied) head as packed INT8: the map's rows are copied packed, and greedy output
    with drafts from the map is the output without drafts."""
    from tierlm.engine.llm_engine import EngineConfig, LLMEngine
    from tierlm.model.quantization.compressed_tensors import PackQuantizedFormat

    folder = build_demo_model(tmp_path / "int4", "tiny", quantize="int4-mixed", mtp=True)
    token_map = tmp_path / "map.json"
    token_map.write_text(json.dumps(list(range(0, 1024, 3))))

    def run(speculative=None):
        llm = LLMEngine(EngineConfig(model=str(folder), dtype="float32", device="cpu", max_num_seqs=1,
                                     kv_cache_memory_bytes=32 << 20, speculative_config=speculative))
        llm.add_request("The quick brown fox", SamplingParams(temperature=0, max_tokens=10))
        while llm.has_unfinished_requests():
            done = [o for o in llm.step() if o.finished]
        return llm, done[0].outputs[0].token_ids

    _, expected = run()
    llm, got = run(json.dumps({"method": "mtp", "num_speculative_tokens": 2, "speculative_token_map": str(token_map)}))
    head = llm.runner.model.mtp.draft_head
    assert isinstance(head.quant_method.format, PackQuantizedFormat) and head.quant_method.format.bits == 8
    assert head.weight_packed.dtype == torch.int32 and head.out_features == 342
    assert got == expected and llm.stats().num_draft_tokens > 0
