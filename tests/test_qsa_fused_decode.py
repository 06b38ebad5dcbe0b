"""The QSA layer's decode step through its fused kernels against its torch path: static decode steps of a
small model with the fused predicates forced on (CUDA's choice; on CPU under TRITON_INTERPRET=1), the torch
path beside it from the same caches; first the prompts' prefill both ways (its selection through the
kernels: the prompts see up to 16 blocks, the budget 2). Checks the wiring (which tensors each kernel is handed), not the
kernels' numerics (their own tests do): fp32, logits and every real cache row within fp32 noise."""

from __future__ import annotations

import copy
import importlib.util
import tempfile
from collections import Counter

import torch
from interpreted import on_cuda_else_interpreted
from reference_models import build_reference

import tierlm.model.layers.qsa_attention as qsa
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.loader import load_model
from tierlm.model.model_cache import ModelCache
from tierlm.model.static_decode import StaticDecodeRunner

BLOCK_SIZE, WIDTH, REQUESTS = 8, 40, 4
FUSED_KERNELS = (  # (module, function) of every kernel a fused QSA decode step launches
    ("tierlm.kernels.norm_rope.triton", "triton_norm_rope_at"),
    ("tierlm.kernels.norm_rope.triton", "triton_norm_rope_kv_write"),
    ("tierlm.kernels.qsa_block_keys.triton", "triton_store_decode_block_keys"),
    ("tierlm.kernels.qsa_block_scores.triton", "triton_block_scores"),
    ("tierlm.kernels.qsa_selection.triton", "triton_selection_rows"),
)


def predicates(fused: bool) -> None:
    """The layer's choice of path, as on CUDA (fused) or as on CPU."""
    qsa.norm_rope_fuses = lambda x: fused
    qsa.selection_fuses = lambda x: fused
    qsa.block_key_store_fuses = lambda x, rope: fused and rope.positions is not None


def compare(steps: int, device: str = "cpu") -> None:
    """(On a GPU in the test's own process: the predicates and kernels are put back after.)"""
    patched = [(qsa, name) for name in ("norm_rope_fuses", "selection_fuses", "block_key_store_fuses")]
    patched += [(importlib.import_module(module), name) for module, name in FUSED_KERNELS]
    saved = [(module, name, getattr(module, name)) for module, name in patched]
    try:
        run_steps(steps, device)
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def run_steps(steps: int, device: str) -> None:
    calls = Counter()
    for module_name, name in FUSED_KERNELS:
        module = importlib.import_module(module_name)
        kernel = getattr(module, name)
        setattr(module, name, lambda *a, kernel=kernel, name=name, **k: calls.update([name]) or kernel(*a, **k))
    with tempfile.TemporaryDirectory() as folder:
        build_reference("hc4_ple", folder)
        model, config = load_model(folder, dtype="float32", device=device)
    cache = ModelCache(config, REQUESTS + 1, REQUESTS * WIDTH, BLOCK_SIZE, torch.float32, device)
    tables = [list(range(i * WIDTH, (i + 1) * WIDTH)) for i in range(REQUESTS)]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, config.vocab_size, (n,), generator=gen).tolist() for n in (30, 7, 64, 3)]
    for slot in range(REQUESTS):
        cache.reset_slot(slot)
    fresh = copy.deepcopy(cache)
    prefill = [ForwardBatch.build(prompts, [0] * REQUESTS, list(range(REQUESTS)), tables, BLOCK_SIZE, device=device)
               for _ in range(2)]
    outputs = []  # every QSA layer's output on every prompt row (the logits are the last rows' only)
    hooks = [module.register_forward_hook(lambda module, args, out: outputs.append(out.clone()))
             for module in model.modules() if isinstance(module, qsa.QSAAttention)]
    predicates(False)
    expected, torch_outputs = model(prefill[0], cache).clone(), outputs[:]
    outputs.clear()
    predicates(True)  # the prefill's selection (and K/V write) through the kernels: prompts of 3-64 tokens
    torch.testing.assert_close(model(prefill[1], fresh), expected, rtol=1e-5, atol=1e-5)
    for hook in hooks:
        hook.remove()
    assert len(outputs) == len(torch_outputs) > 0
    for got, want in zip(outputs, torch_outputs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    fused_cache = copy.deepcopy(cache)
    torch_runner = StaticDecodeRunner(model, cache, REQUESTS, WIDTH, "eager")
    fused_runner = StaticDecodeRunner(model, fused_cache, REQUESTS, WIDTH, "eager")
    positions = [len(p) for p in prompts]
    for step in range(steps):
        active = [r for r in range(REQUESTS) if (step + r) % 4]  # 3 of 4: a padded batch
        tokens = [[int(torch.randint(2, config.vocab_size, (1,), generator=gen))] for _ in active]
        batches = [ForwardBatch.build(tokens, [positions[r] for r in active], active, [tables[r] for r in active],
                                      BLOCK_SIZE, device=device) for _ in range(2)]
        predicates(False)
        expected = torch_runner.run(batches[0])
        predicates(True)
        torch.testing.assert_close(fused_runner.run(batches[1]), expected, rtol=1e-5, atol=1e-5)
        for r in active:
            positions[r] += 1
    assert set(calls) == {name for _, name in FUSED_KERNELS}, calls
    real = REQUESTS * WIDTH
    for state, fused_state in zip(cache.layers, fused_cache.layers):
        if state.key_cache is not None:
            for name in ("key_cache", "value_cache", "index_keys"):
                torch.testing.assert_close(getattr(fused_state, name)[:real], getattr(state, name)[:real],
                                           rtol=1e-5, atol=1e-5)
            assert torch.equal(fused_state.index_ring[:REQUESTS], state.index_ring[:REQUESTS])


def test_fused_qsa_decode_equals_the_torch_path():
    on_cuda_else_interpreted(lambda: compare(steps=24, device="cuda"), INTERPRETED_EARLY, "test_fused_qsa_decode_equals_the_torch_path")


INTERPRETED_EARLY = {  # (queued when collection ends, see tests/interpreted.py)
    "test_fused_qsa_decode_equals_the_torch_path": ("import test_qsa_fused_decode as t; t.compare(steps=3)",),
}
