"""The sampling pass on fixed shapes (`PassShape`: padded edits and ranks), and replayed from CUDA graphs
(`SamplingGraphs`): padding changes no token, shapes repeat within a bucket, and a replayed pass gives
the eager pass's tokens, statuses and log-probabilities bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sampler_reference import VOCAB, _batch

from tierlm.engine.request import Request
from tierlm.engine.sampler import Sampler
from tierlm.engine.sampler_reference import reference_sample_rows
from tierlm.engine.sampling_pass import PackedPlan, sample_rows
from tierlm.engine.sampling_plan import plan_rows
from tierlm.sampling_params import SamplingParams


def _penalized(outputs: int, params: SamplingParams | None = None) -> Request:
    params = params or SamplingParams(temperature=0.9, top_k=7, repetition_penalty=1.3, frequency_penalty=0.4)
    return Request("p", [3, 4], params.with_defaults(None, None, None), frozenset({0}), 1024,
                   output_token_ids=[(7 * i) % VOCAB for i in range(outputs)])


def test_shapes_repeat_within_a_bucket_and_padding_points_past_the_logits():
    keys = np.zeros(1, dtype=np.uint64)

    def packed(outputs: int) -> PackedPlan:
        return PackedPlan(plan_rows([_penalized(outputs)], VOCAB, keys))

    assert packed(17).shape == packed(32).shape != packed(33).shape  # outputs padded to 32, then 64
    padded = packed(17)
    offset = sum(size[0] for name, size in padded.shape.ints[: 2])  # after the pending entries
    flat = padded.words[offset : offset + dict(padded.shape.ints)["output_flat"][0]]
    assert len(flat) == 32 and (flat[17:32] == VOCAB).all()  # one row: index VOCAB is past it
    assert padded.shape.prompts  # its repetition penalty reads the prompt's bitmask (not its ids)
    assert padded.shape.k_max == 16  # top_k 7, ranks padded to 16 (the rest cut)
    assert packed(5).shape != PackedPlan(plan_rows([_penalized(5)], VOCAB, keys), logprobs=2).shape


@pytest.mark.parametrize("outputs", [1, 15, 16, 17, 40])
def test_padding_changes_no_token(outputs):
    """Rows whose penalized ids, biases and top-k ranks fill their buckets partly: the reference's tokens."""
    generator = torch.Generator().manual_seed(outputs)
    logits = torch.randn(3, VOCAB, generator=generator) * 2
    logits[:, [(7 * i) % VOCAB for i in range(outputs)]] += 4  # the penalties decide among the seen ids
    requests = [_penalized(outputs),
                _penalized(outputs, SamplingParams(temperature=0.7, top_p=0.6, presence_penalty=1.0,
                                                   logit_bias={i: 0.5 for i in range(outputs)})),
                _penalized(outputs, SamplingParams(temperature=0))]
    for seed in range(4):
        plan = plan_rows(requests, VOCAB, Sampler(seed, graphs=False).row_keys(requests))
        tokens, status = sample_rows(logits, plan)
        expected_tokens, expected_status = reference_sample_rows(logits, plan)
        assert tokens.tolist() == expected_tokens.tolist() and status.tolist() == expected_status.tolist()


def test_a_shape_s_first_pass_is_left_to_the_eager_pass():
    """`SamplingGraphs.run` declines a shape it has not met (None: the caller runs it eagerly), so a shape
    that comes once costs no capture; it remembers the shape (its next pass is captured, on a GPU)."""
    from tierlm.engine.sampler_graphs import SamplingGraphs
    from tierlm.engine.sampling_pass import sampling_pass

    graphs = SamplingGraphs(sampling_pass)
    packed = PackedPlan(plan_rows([_penalized(3)], VOCAB, np.zeros(1, dtype=np.uint64)))
    assert graphs.run(packed.shape, torch.zeros(1, VOCAB), packed.words, None, None, None) is None
    assert packed.shape in graphs.seen and graphs.captures == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA graphs)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_replayed_pass_is_the_eager_pass(dtype):
    """Every kind of row (`_batch`: penalties, biases, bans, bitmasks, top-k, top-p, min-p, NaN, all masked,
    +inf), some asking for log-probabilities: the graphs' outcomes equal the eager pass's, step after step
    (a shape's first pass eager, its second captured, the next replayed); a batch of other rows captures one
    more, at its second pass."""
    logits, requests = _batch()
    logits = logits.to(dtype).cuda()
    for i in (0, 2, 5):
        requests[i].params.logprobs = 3
    eager, graphed = Sampler(11, graphs=False), Sampler(11)
    assert graphed.graphs is not None
    for _ in range(3):
        expected = eager.sample(logits, requests, str)
        got = graphed.sample(logits, requests, str)
        assert [(s.token_id, s.error, s.logprobs) for s in got] == [(s.token_id, s.error, s.logprobs)
                                                                  for s in expected]
    assert graphed.graphs.captures == 1
    assert got[0].logprobs is not None and got[9].error is not None
    top_k_rows = [requests[i] for i in (1, 7, 13)]  # top-k draws alone: no draw over the vocabulary
    for _ in range(2):
        assert ([s.token_id for s in graphed.sample(logits[[1, 7, 13]], top_k_rows, str)]
                == [s.token_id for s in eager.sample(logits[[1, 7, 13]], top_k_rows, str)])
    assert graphed.graphs.captures == 2


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_a_placeholder_read_on_the_device_is_the_id_appended_on_the_host(device):
    """Overlap scheduling: a penalized request whose last output id is a placeholder (sampled by the step
    in flight) samples, from the id read on the device, what it samples with that id on the host; padded
    pending entries (two placeholders of four rows, bucket 16) change nothing. On CUDA through the
    graphs, and the eager pass."""
    generator = torch.Generator().manual_seed(5)
    previous_logits = torch.randn(3, VOCAB, generator=generator).to(device)
    params = SamplingParams(temperature=0.8, top_k=12, repetition_penalty=1.5, frequency_penalty=0.7,
                            presence_penalty=0.4).with_defaults(None, None, None)
    plain = SamplingParams(temperature=1.0).with_defaults(None, None, None)

    def requests(known: list[int] | None) -> list[Request]:
        """Rows 0 and 2 penalized, with output [9, 4] and then `known`'s id for the row."""
        return [Request(f"r{i}", [3, 4], p, frozenset({0}), 1024, output_token_ids=[9, 4, *([] if known is None
                                                                                              else [known[i]])])
                for i, p in enumerate([params, plain, params, plain])]

    for graphs in ([False, True] if device == "cuda" else [False]):
        earlier = Sampler(0, graphs=graphs)
        waiting = requests(None)
        in_flight = earlier.launch(previous_logits, [waiting[2], waiting[0], waiting[1]])  # its rows 0, 1, 2
        for request in waiting:  # as the engine counts them at launch
            request.add_placeholder()
        tokens = [s.token_id for s in earlier.collect(in_flight, str)]
        known = [tokens[1], tokens[2], tokens[0], 0]  # row 3's placeholder (not penalized) is never read
        logits = torch.randn(4, VOCAB, generator=generator).to(device)
        logits[:, [known[0], known[2], 9, 4]] += 5  # the penalties decide among the ids seen
        for seed in range(4):
            sampler, on_host = Sampler(seed, graphs=graphs), Sampler(seed, graphs=False)
            for _ in range(2):  # graphs: the shape's first pass eager, its second captured
                drawn = sampler.collect(sampler.launch(logits, waiting, in_flight), str)
                expected = on_host.sample(logits, requests(known), str)
                assert [s.token_id for s in drawn] == [s.token_id for s in expected], (graphs, seed)
            assert not graphs or sampler.graphs.captures == 1
        with pytest.raises(RuntimeError, match="no step in flight"):
            Sampler(0, graphs=graphs).launch(logits, waiting)


def test_a_prompt_is_sent_once_as_a_bitmask():
    """A repetition penalty counts the prompt's ids as seen through the request's prompt bitmask, made once
    and kept on the request (the step's plan sends no prompt ids); a row without one reads zeros."""
    from tierlm.engine.sampling_pass import prompt_bitmasks

    prompt = [3, 40, 299, 40, 10**6]  # an id past the vocabulary is never seen
    params = SamplingParams(temperature=1.0, repetition_penalty=1.2).with_defaults(None, None, None)
    requests = [Request("a", prompt, params, frozenset({0}), 1024),
                Request("b", prompt, SamplingParams(temperature=1.0).with_defaults(None, None, None), frozenset({0}),
                        1024)]
    keys = np.zeros(2, dtype=np.uint64)
    first = prompt_bitmasks(plan_rows(requests, VOCAB, keys), torch.device("cpu"))
    again = prompt_bitmasks(plan_rows(requests, VOCAB, keys), torch.device("cpu"))
    assert again[0] is first[0]  # made once
    bits = first[0].numpy().view(np.uint32)
    seen = [t for t in range(VOCAB) if bits[t // 32] >> (t % 32) & 1]
    assert seen == [3, 40, 299] and not first[1].any()
    layout = dict(PackedPlan(plan_rows(requests, VOCAB, keys)).shape.ints)
    assert sum(size[0] for size in layout.values()) < 16  # keys and flags; no prompt id is sent
