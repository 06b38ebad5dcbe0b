"""The MTP draft head (model/mtp.py) and its checkpoints.

There is no transformers MTP, so the reference here is the math of vLLM's `Qwen4ExpMultiTokenPredictor`
written out plainly (`reference_draft`): norms, projections and the unit-weight combine by hand, the draft's
QSA decoder layer and final mixer run by transformers' own modules (a one-layer reference model whose
layer and mixer become `mtp.layers.0` and `mtp.hyper_connection_mixer`), the target's lm_head. The target
is a transformers checkpoint of the fact sheet's config, and its pre-final-mixer streams (what the draft
reads) are checked against transformers' too. fp32 within the parity tests' tolerance; bf16 within twice
the reference's own bf16 error (the bf16 parity tests' rule). Then: drafting a sequence in chunks and
single steps gives the logits of drafting it at once (the draft layer's caches), and loading (skipped
unless asked, errors, shared head, VLM names, the demo model's head, a quantized head).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from reference_models import BASE, BLOCK_SIZE, BLOCKS_PER_REQUEST, build_reference, prompt_ids
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_bf16_parity import (
    ChoiceRecorder,
    ReferenceChoices,
    assert_clear_margins,
    assert_within_reference_error,
)

from tierlm.cli import main as cli_main
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.loader import CheckpointError, load_model
from tierlm.model.model_cache import ModelCache
from tierlm.tools.quantize import quantize_checkpoint

TOLERANCE = 1e-4  # fp32, as the target's parity tests
LENGTH = 40  # draft rows per request (> budget + R - 1 = 11: the indexer's selection matters)
# the parity tests' fact-sheet config with every expert active: no routing choice for bf16 to flip (the
# MoE top-k has its own tests), and every expert's weights count
TARGET = {**BASE, "num_experts_per_tok": BASE["num_experts"]}
# the draft's decoder layer: the target's dims, one QSA layer, no PLE
DRAFT_LAYER = {**TARGET, "num_hidden_layers": 1, "layer_types": ["indexed_attention"], "ple_layer_ids": None}
# inputs whose indexer choices have clear margins in bf16 (see the bf16 test)
SEED = 20


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)


def mtp_input_weights(hidden: int, hc: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "mtp.fc_embedding.weight": torch.randn(hidden, hidden, generator=gen) / hidden**0.5,
        "mtp.fc_hidden.weight": torch.randn(hidden, hidden, generator=gen) / hidden**0.5,
        "mtp.pre_fc_norm_embedding.weight": 0.1 * torch.randn(hidden, generator=gen),
        "mtp.pre_fc_norm_hidden.weight": 0.1 * torch.randn(hc * hidden, generator=gen),
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, target reference, draft-layer reference, the mtp.* input weights): a TARGET checkpoint
    written by transformers, plus an MTP head in `mtp.safetensors` and mtp_num_hidden_layers 1."""
    folder = tmp_path_factory.mktemp("mtp_target")
    target = build_reference(TARGET, folder)
    draft_folder = tmp_path_factory.mktemp("mtp_draft_layer")
    draft = build_reference(DRAFT_LAYER, draft_folder, seed=1)
    weights = mtp_input_weights(BASE["hidden_size"], BASE["hc_count"], seed=2)
    for name, tensor in load_file(draft_folder / "model.safetensors").items():
        if name.startswith(("model.layers.0.", "model.hyper_connection_mixer.")):
            weights["mtp." + name.removeprefix("model.")] = tensor
    save_file(weights, folder / "mtp.safetensors")
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "mtp_num_hidden_layers": 1}))
    return folder, target, draft, weights


def reference_streams(target, ids: torch.Tensor) -> torch.Tensor:
    """transformers' multi-stream state before the final mixer [B, T, hc*H] (full sequences, no cache)."""
    captured = []
    hook = target.model.hyper_connection_mixer.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    with torch.no_grad():
        target(ids, use_cache=False)
    hook.remove()
    return captured[0]


def reference_draft(target, draft, weights, next_ids: torch.Tensor, hidden: torch.Tensor, head=None):
    """vLLM's MTP math over one whole sequence from position 0: next_ids [T] (row t: token t+1), hidden
    [T, hc*H] -> (logits [T, V], output streams [T, hc*H]), in hidden's dtype (norms in fp32, as vLLM's)."""
    cfg = target.config
    h, hc, eps = cfg.hidden_size, cfg.hc_count, cfg.rms_norm_eps
    w = {name: tensor.to(hidden.dtype) for name, tensor in weights.items()}

    def norm(x, weight):
        return gemma_rms_norm(x.float(), weight.float(), eps).to(x.dtype)

    with torch.no_grad():
        e = F.linear(norm(target.model.embed_tokens(next_ids), w["mtp.pre_fc_norm_embedding.weight"]),
                     w["mtp.fc_embedding.weight"])
        # one norm over all hc*H values (not per stream), then fc_hidden on each stream
        u = norm(hidden, w["mtp.pre_fc_norm_hidden.weight"])
        u = F.linear(u.unflatten(-1, (hc, h)), w["mtp.fc_hidden.weight"])
        streams = (u + e[:, None, :]).flatten(-2)[None]  # the embedding added to every stream, weight 1
        t = next_ids.shape[0]
        positions = torch.arange(t).view(1, 1, t).expand(3, 1, t)
        rope = draft.model.rotary_emb(streams, positions)
        causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        out = draft.model.layers[0](streams, position_embeddings=rope, attention_mask=causal)
        mixed = draft.model.hyper_connection_mixer(out)
        logits = F.linear(mixed, head.to(mixed.dtype)) if head is not None else target.lm_head(mixed)
    return logits[0], out[0]


class DraftRunner:
    """Drives the target (`forward_with_streams`) or the draft head over requests with their own slots and
    block tables, chunk by chunk, at the same positions (row t of a draft chunk: token t+1, hidden t)."""

    def __init__(self, model, config, num_requests: int, dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.cache = ModelCache(config, num_requests, num_requests * BLOCKS_PER_REQUEST, BLOCK_SIZE, dtype,
                                num_draft_layers=config.num_mtp_layers)
        self.tables = [list(range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST)) for i in range(num_requests)]
        self.positions = {"target": [0] * num_requests, "draft": [0] * num_requests}
        for slot in range(num_requests):
            self.cache.reset_slot(slot)

    def _batch(self, kind: str, chunks: dict[int, list[int]]) -> tuple[list[int], ForwardBatch]:
        reqs = sorted(chunks)
        batch = ForwardBatch.build([chunks[r] for r in reqs], [self.positions[kind][r] for r in reqs], reqs,
                                   [self.tables[r] for r in reqs], BLOCK_SIZE, logits="all")
        for r, (start, end) in zip(reqs, batch.bounds):
            self.positions[kind][r] += end - start
        return reqs, batch

    def target(self, chunks: dict[int, list[int]]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        reqs, batch = self._batch("target", chunks)
        logits, streams = self.model.forward_with_streams(batch, self.cache)
        return {r: (logits[s:e], streams[s:e]) for r, (s, e) in zip(reqs, batch.bounds)}

    def draft(self, chunks: dict[int, tuple[list[int], torch.Tensor]]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        reqs, batch = self._batch("draft", {r: ids for r, (ids, _) in chunks.items()})
        hidden = torch.cat([chunks[r][1] for r in reqs])
        logits, streams = self.model.draft(batch, hidden, self.cache)
        return {r: (logits[s:e], streams[s:e]) for r, (s, e) in zip(reqs, batch.bounds)}


@pytest.fixture(scope="module")
def loaded(checkpoint):
    folder = checkpoint[0]
    return load_model(folder, dtype="float32", device="cpu", load_mtp=True)


@pytest.fixture(scope="module")
def sequences(checkpoint, loaded):
    """Two requests' ids [2, LENGTH + 1] and transformers' target streams at their first LENGTH [2, LENGTH,
    hc*H]: draft row t reads token t+1 and streams t."""
    ids = prompt_ids(loaded[1], 2, LENGTH + 1, seed=SEED)
    return ids, reference_streams(checkpoint[1], ids[:, :LENGTH])


def test_target_returns_its_streams_before_the_final_mixer(loaded, sequences):
    model, config = loaded
    ids, expected = sequences
    ids = ids[:, :LENGTH]
    runner = DraftRunner(model, config, 2)
    first = runner.target({0: ids[0, :25].tolist(), 1: ids[1].tolist()})
    second = runner.target({0: ids[0, 25:].tolist()})  # request 0's second chunk
    got = {0: [torch.cat([a, b]) for a, b in zip(first[0], second[0])], 1: first[1]}
    for r in (0, 1):
        logits, streams = got[r]
        assert (streams - expected[r]).abs().max().item() <= TOLERANCE
        # the logits are lm_head(final mixer(streams)), as forward gives them
        assert torch.allclose(logits, model.lm_head(model.model.mix(streams)), atol=1e-6)


def test_draft_matches_the_reference_math(checkpoint, loaded, sequences):
    _, target, draft, weights = checkpoint
    model, config = loaded
    ids, hidden = sequences
    runner = DraftRunner(model, config, 2)
    got = runner.draft({r: (ids[r, 1:].tolist(), hidden[r]) for r in (0, 1)})
    for r in (0, 1):
        logits, streams = reference_draft(target, draft, weights, ids[r, 1:], hidden[r])
        assert (got[r][0] - logits).abs().max().item() <= TOLERANCE
        assert (got[r][1] - streams).abs().max().item() <= TOLERANCE


def test_draft_in_chunks_and_steps_equals_drafting_at_once(loaded, sequences):
    """The draft layer's K/V, compressed keys and ring carry a request across forwards exactly: chunks of
    uneven size, single-row (decode) steps across compression-group and block boundaries, a chunk after
    steps, two requests at different positions in one batch."""
    model, config = loaded
    ids, hidden = sequences
    whole = DraftRunner(model, config, 2).draft({r: (ids[r, 1:].tolist(), hidden[r]) for r in (0, 1)})
    runner = DraftRunner(model, config, 2)
    pieces: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    # request 0: chunks 7, 1, 13, steps over positions 21..28, the rest; request 1: steps while 0 prefills,
    # a chunk of 18, steps over positions 21..28, the rest
    plan = [{0: 7, 1: 1}, {0: 1, 1: 1}, {0: 13, 1: 1}, {1: 18}] + [{0: 1, 1: 1}] * 8 + [{0: 11, 1: 11}]
    done = [0, 0]
    for step in plan:
        chunks = {r: (ids[r, done[r] + 1 : done[r] + n + 1].tolist(), hidden[r, done[r] : done[r] + n])
                  for r, n in step.items()}
        for r, (logits, _) in runner.draft(chunks).items():
            pieces[r].append(logits)
            done[r] += logits.shape[0]
    assert done == [LENGTH, LENGTH]
    for r in (0, 1):
        assert (torch.cat(pieces[r]) - whole[r][0]).abs().max().item() <= TOLERANCE


def test_later_draft_steps_read_the_previous_step_streams(checkpoint, loaded, sequences):
    """Step k > 0 feeds the draft its own output streams: the same math with that hidden input."""
    _, target, draft, weights = checkpoint
    model, config = loaded
    ids, hidden = sequences[0][0], sequences[1][0]
    runner = DraftRunner(model, config, 1)
    prefill = runner.draft({0: (ids[1 : LENGTH + 1].tolist(), hidden)})[0]
    proposed = int(prefill[0][-1].argmax())
    logits, _ = runner.draft({0: ([proposed], prefill[1][-1:])})[0]
    rows = torch.cat([ids[1 : LENGTH + 1], torch.tensor([proposed])])
    expected, _ = reference_draft(target, draft, weights, rows, torch.cat([hidden, prefill[1][-1:]]))
    assert (logits[0] - expected[-1]).abs().max().item() <= TOLERANCE


def test_a_draft_step_mixes_without_a_row_gather(loaded, sequences, monkeypatch):
    """A decode-shaped draft step (one row per request, every row's logits) takes the final mixer over its
    rows as they are, its layer's MoE combine folded into the mixer (`Qwen4ExpForCausalLM.draft`: no
    `wanted_rows` gather, `mix_pending` with the combine pending); the logits are those of the unfolded
    path (the layer combines at its end, TIERLM_NO_FOLD_LAYER_COMBINE=1). A pass over 1 + K rows of which
    one per request is wanted gathers them past the layer's attention (its streams, attention output and
    injection gates: the mixers' kernels take no row index), and nothing after."""
    model, config = loaded
    ids, hidden = sequences
    gathers, pending_mixes = [], []
    final_mixer = model.mtp.hyper_connection_mixer
    wanted_rows, mix_pending = ForwardBatch.wanted_rows, final_mixer.mix_pending

    def counted_gather(batch, rows):
        gathers.append(batch.logits_every_row)
        return wanted_rows(batch, rows)

    def counted_mix(pending):
        pending_mixes.append(pending.block_output is not None)
        return mix_pending(pending)

    monkeypatch.setattr(ForwardBatch, "wanted_rows", counted_gather)
    monkeypatch.setattr(final_mixer, "mix_pending", counted_mix)
    steps = {}
    for fold in (True, False):
        if fold:
            monkeypatch.delenv("TIERLM_NO_FOLD_LAYER_COMBINE", raising=False)
        else:
            monkeypatch.setenv("TIERLM_NO_FOLD_LAYER_COMBINE", "1")
        runner = DraftRunner(model, config, 2)
        runner.draft({r: (ids[r, 1:21].tolist(), hidden[r, :20]) for r in (0, 1)})
        gathers.clear()
        pending_mixes.clear()
        steps[fold] = runner.draft({r: (ids[r, 21:22].tolist(), hidden[r, 20:21]) for r in (0, 1)})
        assert gathers == [] and pending_mixes == [fold], (fold, gathers, pending_mixes)
    for r in (0, 1):
        for ours, theirs in zip(steps[True][r], steps[False][r], strict=True):
            torch.testing.assert_close(ours, theirs)
    batch = ForwardBatch.build([[3, 4, 5], [6, 7, 8]], [21, 21], [0, 1], runner.tables, BLOCK_SIZE)  # last rows
    gathers.clear()
    model.draft(batch, hidden[:, 21:24].flatten(0, 1), runner.cache)
    assert gathers == [False] * 3


def test_past_its_attention_the_draft_layer_runs_its_logits_rows_only(checkpoint, loaded, sequences, monkeypatch):
    """A draft pass whose logits rows are some of its rows (a pass over 1 + K verify rows, a prefill chunk)
    runs its layer past the attention on those rows only (`DecoderLayer.forward`'s wanted_rows_only; none:
    the caches only): their logits and output streams are those of every row through the whole layer, taken
    after (TIERLM_MTP_EVERY_ROW=1), and so is the next pass over the caches they left (every row's logits). fp32
    within TOLERANCE; bf16 within twice the every-row bf16 path's own distance from the fp32 one."""
    ids, hidden = sequences

    def passes(model, config, dtype: torch.dtype, every_row: bool) -> list[torch.Tensor]:
        if every_row:
            monkeypatch.setenv("TIERLM_MTP_EVERY_ROW", "1")
        else:
            monkeypatch.delenv("TIERLM_MTP_EVERY_ROW", raising=False)
        runner = DraftRunner(model, config, 2, dtype)
        streams = hidden.to(dtype)
        # positions 0-15 with no logits rows (a prefill chunk that samples nothing: the caches only)
        batch = ForwardBatch.build([ids[r, 1:17].tolist() for r in (0, 1)], [0, 0], [0, 1], runner.tables,
                                   BLOCK_SIZE, logits=[])
        logits, out = model.draft(batch, streams[:, :16].flatten(0, 1), runner.cache)
        assert logits.shape[0] == out.shape[0] == 0
        # three rows a request at positions 16-18; wanted: request 0's first row, request 1's last
        batch = ForwardBatch.build([ids[r, 17:20].tolist() for r in (0, 1)], [16, 16], [0, 1], runner.tables,
                                   BLOCK_SIZE, logits=[0, 5])
        assert not batch.logits_every_row
        logits, out = model.draft(batch, streams[:, 16:19].flatten(0, 1), runner.cache)
        assert logits.shape[0] == out.shape[0] == 2
        runner.positions["draft"] = [19, 19]
        after = runner.draft({r: (ids[r, 20:24].tolist(), streams[r, 19:23]) for r in (0, 1)})
        return [logits, out, *(t for r in (0, 1) for t in after[r])]

    model, config = loaded
    every, pruned = passes(model, config, torch.float32, True), passes(model, config, torch.float32, False)
    for ours, theirs in zip(pruned, every, strict=True):
        assert (ours - theirs).abs().max().item() <= TOLERANCE
    model16, config16 = load_model(checkpoint[0], dtype="bfloat16", device="cpu", load_mtp=True)
    every16 = passes(model16, config16, torch.bfloat16, True)
    pruned16 = passes(model16, config16, torch.bfloat16, False)
    for ours, theirs, reference in zip(pruned16, every16, every, strict=True):
        own_error = (theirs.float() - reference).abs().max().item()
        assert (ours.float() - reference).abs().max().item() <= 2 * own_error + 1e-6


def test_draft_bf16_within_the_reference_bf16_error(checkpoint, loaded, sequences, monkeypatch):
    """In bf16 the draft stays as close to the fp32 reference as the reference's own bf16 run does (the
    bf16 parity tests' rule), its top-k choices (indexer blocks, experts) clear of near-ties."""
    folder, target, draft, weights = checkpoint
    ids, hidden = sequences[0][0, 1:], sequences[1][0]
    recorder = ChoiceRecorder(monkeypatch)
    fp32_model, config = loaded
    bf16_model, _ = load_model(folder, dtype="bfloat16", device="cpu", load_mtp=True)
    fp32_logits, _fp32_streams = DraftRunner(fp32_model, config, 1).draft({0: (ids.tolist(), hidden)})[0]
    fp32_choices = recorder.take()
    bf16_logits, bf16_streams = DraftRunner(bf16_model, config, 1, torch.bfloat16).draft(
        {0: (ids.tolist(), hidden.bfloat16())})[0]
    assert assert_clear_margins(fp32_choices, recorder.take()) > 0
    draft_fp32, draft_bf16 = copy.deepcopy(draft), copy.deepcopy(draft).bfloat16()  # copies: hooks stay local
    fp32_reference_choices, bf16_reference_choices = ReferenceChoices(draft_fp32), ReferenceChoices(draft_bf16)
    reference_logits, reference_streams_ = reference_draft(target, draft_fp32, weights, ids, hidden)
    their_logits, their_streams = reference_draft(copy.deepcopy(target).bfloat16(), draft_bf16, weights, ids,
                                                  hidden.bfloat16())
    # the reference's bf16 run chooses as its fp32 run does
    for fp32_choice, bf16_choice in zip(fp32_reference_choices.choices, bf16_reference_choices.choices, strict=True):
        assert torch.equal(fp32_choice, bf16_choice)
    assert (fp32_logits - reference_logits).abs().max().item() <= TOLERANCE
    assert_within_reference_error(bf16_logits, their_logits, reference_logits, "draft logits")
    assert_within_reference_error(bf16_streams, their_streams, reference_streams_, "draft streams")


def _edited_copy(folder: Path, out: Path, edit) -> Path:
    shutil.copytree(folder, out)
    tensors = load_file(out / "mtp.safetensors")
    edit(tensors)
    save_file(tensors, out / "mtp.safetensors")
    return out


def test_the_head_is_skipped_unless_asked_for(checkpoint, loaded, tmp_path):
    folder = checkpoint[0]
    model, _ = load_model(folder, dtype="float32", device="cpu")
    assert model.mtp is None
    with_head, _ = loaded
    target_params = dict(with_head.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, target_params[name]), name
    with pytest.raises(RuntimeError, match="without its MTP draft head"):
        model.draft(ForwardBatch.build([[1]], [0], [0], [[0]], BLOCK_SIZE), torch.zeros(1, 256),
                    ModelCache(model.config, 1, 1, BLOCK_SIZE, torch.float32))
    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    (plain / "mtp.safetensors").unlink()
    with pytest.raises(CheckpointError, match="has no MTP draft head"):
        load_model(plain, device="cpu", load_mtp=True)


def test_a_missing_or_extra_head_tensor_is_named(checkpoint, tmp_path):
    folder = checkpoint[0]
    missing = _edited_copy(folder, tmp_path / "missing", lambda t: t.pop("mtp.fc_hidden.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor mtp\.fc_hidden\.weight \(expected shape \[64, 64\]\)"):
        load_model(missing, device="cpu", load_mtp=True)
    # two layers in config.json, one in the files
    two = tmp_path / "two"
    shutil.copytree(folder, two)
    raw = json.loads((two / "config.json").read_text())
    (two / "config.json").write_text(json.dumps({**raw, "mtp_num_hidden_layers": 2}))
    with pytest.raises(CheckpointError, match=r"missing tensor mtp\.layers\.1\."):
        load_model(two, device="cpu", load_mtp=True)
    # without being asked for, a broken head does not matter
    load_model(missing, device="cpu")


def test_shared_head_replaces_the_target_lm_head(checkpoint, sequences, tmp_path):
    folder, target, draft, weights = checkpoint
    head = 0.3 * torch.randn(BASE["vocab_size"], BASE["hidden_size"], generator=torch.Generator().manual_seed(5))
    shared = _edited_copy(folder, tmp_path / "shared", lambda t: t.update({"mtp.shared_head.head.weight": head}))
    model, config = load_model(shared, dtype="float32", device="cpu", load_mtp=True)
    ids, hidden = sequences[0][1], sequences[1][1]
    logits, _ = DraftRunner(model, config, 1).draft({0: (ids[1:].tolist(), hidden)})[0]
    expected, _ = reference_draft(target, draft, weights, ids[1:], hidden, head=head)
    assert (logits - expected).abs().max().item() <= TOLERANCE


def test_vlm_names_load_the_same_head(checkpoint, loaded, tmp_path):
    """`model.language_model.mtp.*` (and the VLM prefix on the target) read as `mtp.*`."""
    folder = checkpoint[0]
    vlm = tmp_path / "vlm"
    shutil.copytree(folder, vlm)
    for file in vlm.glob("*.safetensors"):
        renamed = {
            name if name == "lm_head.weight" else "model.language_model." + name.removeprefix("model."): tensor
            for name, tensor in load_file(file).items()
        }
        save_file(renamed, file)
    with safe_open(vlm / "mtp.safetensors", framework="pt") as f:
        assert all(name.startswith("model.language_model.mtp.") for name in f.keys())  # noqa: SIM118 - safe_open is not iterable
    model, _ = load_model(vlm, dtype="float32", device="cpu", load_mtp=True)
    reference = dict(loaded[0].named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, reference[name]), name


def test_demo_model_with_a_head_and_quantized(tmp_path):
    """`demo-model --mtp` writes a head the loader takes (and `--load-format dummy` draws); `quantize`
    carries the head and quantizes its experts like the target's."""
    with_head = tmp_path / "mtp"
    assert cli_main(["demo-model", str(with_head), "--mtp"]) == 0
    assert json.loads((with_head / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    model, config = load_model(with_head, device="cpu", load_mtp=True)
    # --load-format dummy draws, on the CPU, the very values demo-model writes: the head's too
    dummy, _ = load_model(with_head, device="cpu", load_mtp=True, load_format="dummy")
    params = dict(model.named_parameters())
    assert any(name.startswith("mtp.") for name in params)
    for name, param in dummy.named_parameters():
        assert torch.equal(param, params[name]), name
    quantized_dir = quantize_checkpoint(with_head, tmp_path / "int4", "int4", clip_search=False)
    quantized, _ = load_model(quantized_dir, device="cpu", load_mtp=True)
    assert quantized.mtp.layers[0].mlp.experts.quant_method.format.bits == 4
    assert quantized.model.layers[0].mlp.experts.quant_method.format.bits == 4

    # the same inputs through both heads: the INT4 head's logits stay near the dense head's, closer than
    # the target's own (four INT4 layers to the head's one); a head loaded wrong would be far off
    ids = prompt_ids(config, 1, 30, seed=7)[0]
    dense_runner, quant_runner = DraftRunner(model, config, 1), DraftRunner(quantized, config, 1)
    dense_logits, hidden = dense_runner.target({0: ids[:29].tolist()})[0]
    quant_logits, _ = quant_runner.target({0: ids[:29].tolist()})[0]
    dense_draft = dense_runner.draft({0: (ids[1:].tolist(), hidden)})[0][0]
    quant_draft = quant_runner.draft({0: (ids[1:].tolist(), hidden)})[0][0]

    def relative_error(a, b):
        return ((a - b).norm() / b.norm()).item()

    draft_error = relative_error(quant_draft, dense_draft)
    assert 0 < draft_error < relative_error(quant_logits, dense_logits)
