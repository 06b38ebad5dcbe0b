"""Programmatic dependent launch (`kernels/dependent_launch`) changes no bit of a QSA layer's decode step.

The layer's decode step (norm + rotary kernels, the indexer's key store, block scores, selection, decode
attention and its merge; with K/V in host pools, the row cache's store and plan too) is captured in a CUDA
graph once with PDL on and once with TIERLM_NO_PDL=1, each over the same random caches, and replayed
STEPS times one token further each time, its inputs sent by a host-to-device copy before each replay (as
`static_decode` sends them). A kernel that read its inputs before its wait would read the previous
kernel's output of the previous replay (the same addresses): the outputs, the caches after, and the row
cache's tags and counters must be equal bit for bit. The contexts are longer than the indexer's budget,
so every step scores and selects (one request of the four starts within it: the scores kernel skips it
at first). Hopper or later only: elsewhere PDL is off either way."""

from __future__ import annotations

import pytest
import torch
from reference_models import BASE

from tierlm.config import ModelConfig
from tierlm.kernels.dependent_launch import pdl_enabled
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.layers.qsa_attention import QSAAttention
from tierlm.model.layers.rotary import Rope, RotaryEmbedding
from tierlm.model.model_cache import ModelCache

STEPS, BLOCK_SIZE, WIDTH, ARENA_ROWS = 16, 12, 16, 61  # a prime arena: slots collide, rows are evicted
CONTEXTS = [100, 150, 9, 57]  # tokens before the first step; BASE's budget is 8 tokens (2 blocks of 4)

needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="programmatic dependent launch needs a GPU of compute capability 9 or more")


@torch.no_grad()
def replayed_decode_steps(batch_size: int, offload: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The layer's decode step captured under the environment's PDL setting, replayed STEPS times:
    (each replay's output, the caches after the last)."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    config = ModelConfig.from_dict(BASE)
    gen = torch.Generator().manual_seed(0)
    layer = QSAAttention(config)
    for param in layer.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    layer = layer.to(device, dtype)
    cache = ModelCache(config, batch_size, batch_size * WIDTH, BLOCK_SIZE, dtype, device, kv_offload=offload,
                       arena_rows=ARENA_ROWS)
    caches = next(c for c in cache.layers if c.kv is not None)
    for pool in (caches.key_cache, caches.value_cache, caches.index_keys, caches.index_ring):
        pool.copy_(torch.randn(pool.shape, generator=gen).to(dtype))  # every row a context would have written

    # the graph's input buffers and what each step sends into them
    tables = torch.arange(batch_size * WIDTH, device=device).view(batch_size, WIDTH)  # request i: its own blocks
    x, positions, rows = (torch.zeros(batch_size, config.hidden_size, dtype=dtype, device=device),
                          torch.zeros(batch_size, dtype=torch.int64, device=device),
                          torch.zeros(batch_size, dtype=torch.int64, device=device))
    sent = []
    for step in range(STEPS):
        at = torch.tensor(CONTEXTS[:batch_size]) + step
        row = tables.cpu()[torch.arange(batch_size), at // BLOCK_SIZE] * BLOCK_SIZE + at % BLOCK_SIZE
        sent.append([t.pin_memory() for t in (torch.randn(batch_size, config.hidden_size, generator=gen).to(dtype),
                                              at, row)])
    batch = ForwardBatch(
        token_ids=torch.zeros(batch_size, dtype=torch.int64, device=device), positions=positions,
        context_lens=[0] * batch_size, query_lens=[1] * batch_size, state_slots=list(range(batch_size)),
        block_tables=tables, slot_mapping=rows, logits_rows=torch.arange(batch_size, device=device),
        logits_every_row=True, slots=torch.arange(batch_size, device=device), context_lens_tensor=positions,
        static=True)
    rope = Rope(RotaryEmbedding(config.rotary_dim, config.rope_theta, config.mrope_section), batch, dtype)

    def send(step: int) -> None:
        for buffer, host in zip((x, positions, rows), sent[step]):
            buffer.copy_(host, non_blocking=True)

    def forward() -> torch.Tensor:
        return layer(x, batch, caches.kv, caches.indexer, rope)

    send(0)
    side = torch.cuda.Stream()  # warm up (compile the kernels) outside the capture, as static_decode does
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    outputs = []
    for step in range(STEPS):
        send(step)
        graph.replay()
        outputs.append(out.clone())
    torch.cuda.synchronize()  # the host pools are read by the CPU below: after the device is done with them
    state = {name: getattr(caches, name).clone() for name in ("key_cache", "value_cache", "index_keys", "index_ring")}
    if offload:
        row_cache = caches.offload.cache
        state |= {name: getattr(row_cache, name).clone() for name in (
            "keys", "values", "tags", "hitmark", "claims", "epoch", "hits", "misses")}
    return outputs, state


@needs_hopper
@pytest.mark.parametrize("offload", [False, True], ids=["device pools", "host pools through the row cache"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_pdl_changes_no_bit_of_a_captured_decode_step(batch_size, offload, monkeypatch):
    monkeypatch.delenv("TIERLM_NO_PDL", raising=False)
    assert pdl_enabled(torch.device("cuda"))
    with_pdl, state_with_pdl = replayed_decode_steps(batch_size, offload)
    monkeypatch.setenv("TIERLM_NO_PDL", "1")
    assert not pdl_enabled(torch.device("cuda"))
    without, state_without = replayed_decode_steps(batch_size, offload)
    for step, (a, b) in enumerate(zip(with_pdl, without)):
        assert torch.equal(a, b), f"step {step}: {(a.float() - b.float()).abs().max().item()}"
    assert len({tuple(out.flatten().tolist()) for out in with_pdl}) == STEPS  # every step a new output
    for name, value in state_with_pdl.items():
        assert torch.equal(value, state_without[name]), name
    if offload:  # the row cache served rows and missed others
        assert state_with_pdl["hits"] > 0 and state_with_pdl["misses"] > 0
