"""Programmatic dependent launch (`kernels/dependent_launch`) in the decode kernels that use it.

On CPU: every launch in those kernel files passes `**launch_options(...)`, and every kernel it launches
follows the rules of `dependent_launch`: `allow_dependents(PDL)` first, `wait_for_inputs(PDL)` on every
path (a statement of the kernel's body itself, not inside a branch or loop), and before it no argument
read but the kernel's weights (WEIGHTS) and scalars: no input loaded, nothing stored.

On an H200 (compute capability 9+, where PDL is on): the same model's captured decode graphs, and its
captured speculative verification graphs, with PDL and without (TIERLM_NO_PDL=1) give bit-identical
logits over 16 greedy steps in bf16. The kernels and their summation orders are the same either way, so
any difference is a kernel reading an input before the kernel that writes it has finished. Without PDL
the run is first repeated, to show the comparison is meaningful (the step is deterministic).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

KERNELS = Path(__file__).parent.parent / "tierlm" / "kernels"
PDL_FILES = [*(path for folder in ("hyper_connection", "moe_router", "ple", "embed_streams")
               for path in sorted((KERNELS / folder).glob("*.py"))), KERNELS / "gated_delta_rule" / "decode_triton.py",
             KERNELS / "quant_linear" / "triton.py", KERNELS / "fused_moe" / "triton.py",
             KERNELS / "fused_moe" / "packed_decode.py", KERNELS / "speculative_step" / "triton.py"]
# each launched kernel: the arguments it may read before `wait_for_inputs` (weights no kernel of a step
# writes, and scalars); a pointer's `.dtype` is no read
WEIGHTS = {
    "_mix_down_kernel": {"w_ptr", "norm_ptr", "n_tokens"},
    "_mix_up_kernel": {"up_ptr", "up_scale_ptr", "norm_ptr", "n_tokens"},
    "_combine_kernel": set(),
    "_partial_logits_kernel": {"w_ptr", "n_tokens"},
    "_route_kernel": set(),
    "_embed_streams_kernel": set(),
    "_embeddings_kernel": {"multipliers_ptr", "sizes_ptr", "offsets_ptr", "scale_ptr"},
    "_residual_kernel": {"norm_conv_ptr", "conv_weight_ptr"},
    "_advance_context_kernel": set(),
    "_decode_kernel": {"weight", "A_log", "dt_bias"},
    "_gemv_kernel": {"w_ptr", "s_ptr", "M", "N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_sn"},
    "_gemm_kernel": set(),
    "_decode_gemv_kernel": set(),  # (which expert a program reads is an input)
    "_gate_up_kernel": set(),
    "_down_kernel": set(),
    "_sum_chunks_kernel": set(),
    "_split_x_kernel": set(),
    "_packed_decode_kernel": set(),
    "_step_inputs_kernel": set(),
    "_accept_kernel": set(),
    "_finish_kernel": set(),
}


def _call_name(node: ast.AST) -> str | None:
    """`f` of a statement `f(...)`, else None."""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
        return node.value.func.id
    return None


def _names_read(nodes: list[ast.stmt]) -> set[str]:
    """The names the statements read, leaving out `x.dtype` (a pointer's type: no memory access)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Attribute) and node.attr == "dtype":
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            names.add(node.id)
        for child in ast.iter_child_nodes(node):
            visit(child)

    for node in nodes:
        visit(node)
    return names


def _launches(tree: ast.Module) -> list[ast.Call]:
    """Every `kernel[grid](...)` call."""
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
            and isinstance(node.func.value, ast.Name)]


def test_every_launch_passes_launch_options():
    launched = set()
    for path in PDL_FILES:
        tree = ast.parse(path.read_text())
        for call in _launches(tree):
            options = [k.value for k in call.keywords if k.arg is None]
            assert any(isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "launch_options"
                       for v in options), f"{path.name}:{call.lineno}: {call.func.value.id} launched without " \
                                          "**launch_options(device)"
            launched.add(call.func.value.id)
    assert launched == set(WEIGHTS), f"kernels launched {sorted(launched)}, WEIGHTS lists {sorted(WEIGHTS)}"


def test_kernels_wait_before_reading_inputs():
    checked = set()
    for path in PDL_FILES:
        tree = ast.parse(path.read_text())
        for kernel in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in WEIGHTS):
            body = [s for s in kernel.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            assert _call_name(body[0]) == "allow_dependents", f"{kernel.name}: allow_dependents(PDL) must come first"
            waits = [i for i, s in enumerate(body) if _call_name(s) == "wait_for_inputs"]
            assert len(waits) == 1, f"{kernel.name}: one wait_for_inputs(PDL) in the kernel's own body, got {waits}"
            constexprs = {a.arg for a in kernel.args.args if a.annotation is not None}
            params = {a.arg for a in kernel.args.args} - constexprs
            early = (_names_read(body[: waits[0]]) & params) - WEIGHTS[kernel.name]
            assert not early, f"{kernel.name} reads {sorted(early)} before wait_for_inputs (not weights)"
            checked.add(kernel.name)
    assert checked == set(WEIGHTS)


# ---- GPU: decode and verification graphs with and without PDL, bit for bit --------------------------------

BLOCK_SIZE, STEPS = 16, 16


def _pdl_on_here() -> bool:
    from tierlm.kernels.dependent_launch import pdl_enabled

    return torch.cuda.is_available() and pdl_enabled(torch.device("cuda"))


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """The demo-small config (6 GDN layers, PLE on two of them, 2 QSA layers, hc 4, 64 experts) with random
    weights (`load_format="dummy"`), bf16 on the GPU."""
    from tierlm.demo_model import demo_config
    from tierlm.model.loader import load_model

    folder = tmp_path_factory.mktemp("demo_small")
    (folder / "config.json").write_text(json.dumps(demo_config("small", 8192, eos_token_id=1)))
    return load_model(folder, dtype="bfloat16", device="cuda", load_format="dummy")


def greedy_logits(model, config, batch: int, rows: int) -> torch.Tensor:
    """Random prompts prefilled, then STEPS greedy steps through a captured graph (a fresh cache and fresh
    graphs, under the environment as it is): every step's logits [STEPS, batch * rows, vocab]. rows 1:
    decode steps; rows 1 + K: verification steps of the last token and K drafts (random; the state after
    each row kept in its position slot, every row taken as accepted)."""
    from tierlm.model.forward_batch import ForwardBatch
    from tierlm.model.model_cache import ModelCache
    from tierlm.model.static_decode import StaticDecodeRunner

    gen = torch.Generator().manual_seed(batch * 10 + rows)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in (37, 5, 20, 29)[:batch]]
    width = (max(map(len, prompts)) + STEPS * rows) // BLOCK_SIZE + 1
    drafts = rows - 1
    cache = ModelCache(config, batch * rows, batch * width, BLOCK_SIZE, torch.bfloat16, "cuda")
    tables = [list(range(i * width, (i + 1) * width)) for i in range(batch)]
    requests = list(range(batch))
    for slot in requests:
        cache.reset_slot(slot)
    logits = model(ForwardBatch.build(prompts, [0] * batch, requests, tables, BLOCK_SIZE, device="cuda"), cache)
    runner = StaticDecodeRunner(model, cache, batch, width, "cuda_graph", sizes=[batch], widths=[width],
                                rows_per_request=rows)
    position_slots = [[batch + r * drafts + j for j in range(drafts)] for r in requests] if drafts else None
    positions, steps = [len(p) for p in prompts], []
    for _ in range(STEPS):
        last = logits.view(batch, -1, logits.shape[-1])[:, -1].argmax(-1).tolist()
        chunks = [[token, *torch.randint(3, config.vocab_size, (drafts,), generator=gen).tolist()] for token in last]
        step = ForwardBatch.build(chunks, positions, requests, tables, BLOCK_SIZE, device="cuda",
                                  logits="all" if drafts else "last", position_slots=position_slots)
        assert runner.can_run(step)
        logits = runner.run(step)[0] if drafts else runner.run(step)
        steps.append(logits.clone())
        positions = [p + rows for p in positions]
    return torch.stack(steps)


@pytest.mark.skipif(not _pdl_on_here(), reason="PDL runs on CUDA devices of compute capability 9+ only")
@pytest.mark.parametrize("batch,rows", [(1, 1), (4, 1), (4, 3)])
def test_graphs_with_pdl_equal_those_without_bit_for_bit(small_model, monkeypatch, batch, rows):
    model, config = small_model
    monkeypatch.setenv("TIERLM_NO_PDL", "1")
    without = greedy_logits(model, config, batch, rows)
    assert torch.equal(greedy_logits(model, config, batch, rows), without), \
        "the step is not deterministic without PDL: the comparison below would mean nothing"
    monkeypatch.delenv("TIERLM_NO_PDL")
    with_pdl = greedy_logits(model, config, batch, rows)
    differ = (with_pdl != without).flatten(1).any(-1).nonzero().flatten().tolist()
    assert not differ, f"logits with PDL differ from those without at steps {differ} (a race)"
