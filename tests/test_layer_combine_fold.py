"""A decoder layer's MoE combine folded into the next mix (`PendingStreams`, TIERLM_NO_FOLD_LAYER_COMBINE)
gives the same numbers as the combine at the layer's end, bit for bit.

The fold moves where the combine runs, not what it computes: on the fused path the next mix's down
programs (`combine_and_mix`) round the combined streams exactly as `_combine_kernel` does, so the whole
model's logits and streams must be equal, not close. Checked with the hyper-connection kernels forced on
(on CPU in Triton's interpreter, in a child; the model's other layers keep their CPU paths), in fp32 and
bf16, on the demo tiny config: PLE on layers 1 and 2 (layer 2's PLE reads the streams after layer 1's
pending combine) and an MTP draft head (whose layer's combine its own final mixer folds). The number of
combine launches is checked too: the fold must actually take them away. On a GPU also the demo-small
model's captured decode and verification graphs, in bf16, with the fused MoE and router as well.
"""

from __future__ import annotations

import json

import pytest
import torch
from interpreted import interpreted_json

BLOCK_SIZE = 12
PROMPTS = ([5, 9, 17, 33, 2, 8, 40, 11, 3], [7, 21, 4, 19, 6])  # prefill: logits of the last rows only
DECODE_STEPS = 1
# combine launches (`kernels.combine`) over the run of `fold_vs_unfolded`: a prefill, DECODE_STEPS decode
# steps (forward_with_streams) with a draft-head forward after each, one plain decode forward. Unfolded,
# every decoder layer's own (4 target, 1 draft layer). Folded: only where the streams themselves are read,
# the PLE of layer 2 (each target forward) and the prefill's final mixer (its logits rows are not every row)
TARGET_FORWARDS = 1 + DECODE_STEPS + 1
EXPECTED_COMBINES = {"unfolded": 4 * TARGET_FORWARDS + DECODE_STEPS, "folded": TARGET_FORWARDS + 1}


def fold_vs_unfolded(device: str) -> dict[str, dict]:
    """{dtype: {"equal": every output bit for bit equal with the fold and without, "folded": combine
    launches with the fold, "unfolded": without}} for the demo tiny config with an MTP head (random
    weights), the hyper-connection kernels forced on (CPU: interpreted)."""
    from tierlm.kernels.hyper_connection import triton as kernels
    from tierlm.model.layers import hyper_connection

    launches = []
    real_fused, real_combine = hyper_connection.fused, kernels.combine

    def counted_combine(*args):
        launches.append(1)
        return real_combine(*args)

    hyper_connection.fused = lambda streams: True  # (on CUDA already; on CPU the interpreter runs them)
    kernels.combine = counted_combine
    try:
        return _fold_vs_unfolded(device, launches)
    finally:
        hyper_connection.fused, kernels.combine = real_fused, real_combine


def _fold_vs_unfolded(device: str, launches: list) -> dict[str, dict]:
    import os
    import tempfile
    from pathlib import Path

    from tierlm.demo_model import demo_config
    from tierlm.model.loader import load_model

    results = {}
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(demo_config("tiny", 512, eos_token_id=1, mtp=True)))
        for dtype in ("float32", "bfloat16"):
            model, config = load_model(folder, dtype=dtype, device=device, load_format="dummy", load_mtp=True)
            outputs, counts = {}, {}
            for form in ("folded", "unfolded"):
                if form == "folded":
                    os.environ.pop("TIERLM_NO_FOLD_LAYER_COMBINE", None)
                else:
                    os.environ["TIERLM_NO_FOLD_LAYER_COMBINE"] = "1"
                launches.clear()
                outputs[form] = _prefill_decode_and_draft(model, config, device)
                counts[form] = len(launches)
            os.environ.pop("TIERLM_NO_FOLD_LAYER_COMBINE", None)
            equal = all(torch.equal(a, b) for a, b in zip(outputs["folded"], outputs["unfolded"], strict=True))
            results[dtype] = {"equal": equal, **counts}
    return results


def _prefill_decode_and_draft(model, config, device: str) -> list[torch.Tensor]:
    """Two requests: a prefill (forward_with_streams), then DECODE_STEPS decode steps (forward_with_streams,
    and the draft head on their streams), then a plain decode forward: every logits and streams tensor."""
    from tierlm.model.forward_batch import ForwardBatch
    from tierlm.model.model_cache import ModelCache

    dtype = next(model.parameters()).dtype
    width = 4
    cache = ModelCache(config, len(PROMPTS), len(PROMPTS) * width, BLOCK_SIZE, dtype, device,
                       num_draft_layers=config.num_mtp_layers)
    tables = [list(range(i * width, (i + 1) * width)) for i in range(len(PROMPTS))]
    slots = list(range(len(PROMPTS)))
    for slot in slots:
        cache.reset_slot(slot)
    gen = torch.Generator().manual_seed(0)
    batch = ForwardBatch.build([list(p) for p in PROMPTS], [0] * len(PROMPTS), slots, tables, BLOCK_SIZE,
                               device=device)
    logits, streams = model.forward_with_streams(batch, cache)
    out = [logits, streams]
    positions = [len(p) for p in PROMPTS]
    for _ in range(DECODE_STEPS):
        tokens = torch.randint(2, config.vocab_size, (len(PROMPTS),), generator=gen).tolist()
        batch = ForwardBatch.build([[t] for t in tokens], positions, slots, tables, BLOCK_SIZE, device=device)
        logits, streams = model.forward_with_streams(batch, cache)
        following = torch.randint(2, config.vocab_size, (len(PROMPTS),), generator=gen).tolist()
        draft_batch = ForwardBatch.build([[t] for t in following], positions, slots, tables, BLOCK_SIZE,
                                         device=device)
        out += [logits, streams, *model.draft(draft_batch, streams, cache)]
        positions = [p + 1 for p in positions]
    tokens = torch.randint(2, config.vocab_size, (len(PROMPTS),), generator=gen).tolist()
    out.append(model(ForwardBatch.build([[t] for t in tokens], positions, slots, tables, BLOCK_SIZE, device=device),
                     cache))
    return [t.float().cpu() for t in out]


# the interpreted child's mix tiles sized to the tiny widths (H 128, r 16): its time goes with the programs it
# runs (the shipped tiles' 8-column up programs took 77 s of the queue, these 19 s); fold and no fold share them
CHILD = ("import json, tierlm.kernels.hyper_connection.triton as k\n"
         "k.MIX_TILES = ((1, k.MixTiles(1, 16, 128, 4, 128, 4)), (4, k.MixTiles(4, 16, 128, 4, 128, 4)),\n"
         "               (k.MAX_TOKENS, k.MixTiles(16, 16, 128, 4, 64, 4)))\n"
         "import test_layer_combine_fold as t; print(json.dumps(t.fold_vs_unfolded('cpu')))")
INTERPRETED_EARLY = {"test_fold_gives_the_unfolded_numbers_bit_for_bit": (CHILD,)}  # (see tests/interpreted.py)


def test_fold_gives_the_unfolded_numbers_bit_for_bit():
    """With the hyper-connection kernels (CPU: interpreted), the fold's logits, streams and draft outputs
    equal the unfolded ones in fp32 and bf16, with EXPECTED_COMBINES combine launches each way."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        results = fold_vs_unfolded("cuda")
    else:
        results = interpreted_json(*INTERPRETED_EARLY["test_fold_gives_the_unfolded_numbers_bit_for_bit"])
    for dtype in ("float32", "bfloat16"):
        assert results[dtype] == {"equal": True, **EXPECTED_COMBINES}, dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_is_the_same_with_and_without_the_fold(tmp_path, monkeypatch, dtype):
    """On the torch path (CPU) the fold runs the same ops in the same order: equal outputs, in-process."""
    from tierlm.demo_model import demo_config
    from tierlm.model.loader import load_model

    (tmp_path / "config.json").write_text(json.dumps(demo_config("tiny", 512, eos_token_id=1, mtp=True)))
    model, config = load_model(tmp_path, dtype=dtype, device="cpu", load_format="dummy", load_mtp=True)
    monkeypatch.delenv("TIERLM_NO_FOLD_LAYER_COMBINE", raising=False)
    folded = _prefill_decode_and_draft(model, config, "cpu")
    monkeypatch.setenv("TIERLM_NO_FOLD_LAYER_COMBINE", "1")
    unfolded = _prefill_decode_and_draft(model, config, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(folded, unfolded, strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("batch,rows", [(1, 1), (4, 1), (4, 3)])
def test_captured_graphs_equal_with_and_without_the_fold_on_gpu(tmp_path, monkeypatch, batch, rows):
    """The demo-small model (PLE on two layers) in bf16, every fused kernel on: captured decode (rows 1)
    and verification (rows 3) graphs give bit-identical logits over greedy steps with the fold and without."""
    from test_dependent_launch import greedy_logits

    from tierlm.demo_model import demo_config
    from tierlm.model.loader import load_model

    (tmp_path / "config.json").write_text(json.dumps(demo_config("small", 8192, eos_token_id=1)))
    model, config = load_model(tmp_path, dtype="bfloat16", device="cuda", load_format="dummy")
    monkeypatch.setenv("TIERLM_NO_FOLD_LAYER_COMBINE", "1")
    unfolded = greedy_logits(model, config, batch, rows)
    monkeypatch.delenv("TIERLM_NO_FOLD_LAYER_COMBINE")
    folded = greedy_logits(model, config, batch, rows)
    differ = (folded != unfolded).flatten(1).any(-1).nonzero().flatten().tolist()
    assert not differ, f"logits with the fold differ from those without at steps {differ}"
