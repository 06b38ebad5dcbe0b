"""Programmatic dependent launch (`kernels/dependent_launch`) in the decode kernels that use it.

On CPU: every launch in those kernel files passes `**launch_options(...)`, and every kernel it launches
follows the rules of `dependent_launch`: `allow_dependents(PDL)` first, `wait_for_inputs(PDL)` on every
path (a statement of the kernel's body itself, not inside a branch or loop), and before it no argument
read but the kernel's weights (WEIGHTS) and scalars: no input loaded, nothing stored. The fused MoE's
kernels follow them with early weights off (EARLY_OFF: the kernel's body with those constexprs' branches
taken); with it on, the kernel before each routed phase lets it start only once its own wait has returned
(ONCE_WAITED: wait_for_inputs, then allow_dependents_once_waited, first), and the routed phase waits in
its programs, not in its body (EARLY_READERS): the dependent_launch exception, which the GPU tests below
and test_fused_moe_kernel's race test check on the device.

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
    "_mix_up_kernel": {"up_ptr", "up_scale_ptr", "w_scale_ptr", "norm_ptr", "n_tokens"},
    "_combine_kernel": set(),
    "_partial_logits_kernel": {"w_ptr", "n_tokens"},
    "_route_kernel": set(),
    "_embed_streams_kernel": set(),
    "_embeddings_kernel": {"multipliers_ptr", "sizes_ptr", "offsets_ptr", "scale_ptr"},
    "_residual_kernel": {"norm_conv_ptr", "conv_weight_ptr"},
    "_advance_context_kernel": set(),
    "_decode_kernel": {"weight", "A_log", "dt_bias", "slots", "state_pool"},  # (the state: its own writes only)
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


# early weights (`fused_moe.decode_parts.early_weights`): the constexprs that turn them off (each binding
# checked against the rules), that make a kernel let the next start once it has waited, and that make a
# kernel's routed items read the router's output before their wait
EARLY_OFF = {"_split_x_kernel": [{"EARLY": False}], "_packed_decode_kernel": [{"EARLY": False}],
             "_decode_gemv_kernel": [{"PHASE": "gate_up", "EARLY_TILES": 0}, {"PHASE": "down", "EARLY_TILES": 0}]}
ONCE_WAITED = {"_split_x_kernel": {"EARLY": True}, "_decode_gemv_kernel": {"PHASE": "gate_up", "EARLY_TILES": 2}}
EARLY_READERS = {"_packed_decode_kernel": {"EARLY": True}, "_decode_gemv_kernel": {"PHASE": "down", "EARLY_TILES": 2}}


def _taken(body: list[ast.stmt], constexprs: dict) -> list[ast.stmt]:
    """The statements of `body` as compiled with these constexprs: each `if` whose test reads only them
    replaced by the branch it takes (recursively), the rest as written."""
    flat = []
    for node in body:
        if isinstance(node, ast.If) and _names_read([node.test]) <= set(constexprs):
            taken = eval(compile(ast.Expression(node.test), "<test>", "eval"), {}, dict(constexprs))
            flat += _taken(node.body if taken else node.orelse, constexprs)
        else:
            flat.append(node)
    return flat


def _kernel_bodies(constexprs_of: dict | None = None):
    """(file, kernel, its body without the docstring, as compiled with constexprs_of[kernel] if given) for
    every kernel in WEIGHTS (with constexprs_of: the kernels it names, once per binding it lists)."""
    for path in PDL_FILES:
        tree = ast.parse(path.read_text())
        for kernel in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in WEIGHTS):
            body = [s for s in kernel.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            if constexprs_of is None:
                yield path, kernel, body
                continue
            bindings = constexprs_of.get(kernel.name, [])
            for constexprs in bindings if isinstance(bindings, list) else [bindings]:
                yield path, kernel, _taken(body, constexprs)


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
    for _, kernel, body in _kernel_bodies():
        if kernel.name in EARLY_OFF:
            continue
        _check_waits_first(kernel, body)
        checked.add(kernel.name)
    for _, kernel, body in _kernel_bodies(EARLY_OFF):
        _check_waits_first(kernel, body)
        checked.add(kernel.name)
    assert checked == set(WEIGHTS)


def test_early_weights_follow_the_exception():
    """With early weights on, the kernel before a routed phase triggers only after its wait, and the routed
    phase itself triggers first and does not wait in its body (its programs wait, after their first
    weight loads); with them off, the test above holds each of these kernels to the rules."""
    seen = set()
    for _, kernel, body in _kernel_bodies(ONCE_WAITED):
        assert [_call_name(s) for s in body[:2]] == ["wait_for_inputs", "allow_dependents_once_waited"], \
            f"{kernel.name} with {ONCE_WAITED[kernel.name]}: must wait, then let the next kernel start"
        seen.add(("once waited", kernel.name))
    for _, kernel, body in _kernel_bodies(EARLY_READERS):
        assert _call_name(body[0]) == "allow_dependents", f"{kernel.name}: allow_dependents(PDL) must come first"
        assert "wait_for_inputs" not in [_call_name(s) for s in body], \
            f"{kernel.name} with {EARLY_READERS[kernel.name]}: its programs wait, after their first weights"
        seen.add(("early", kernel.name))
    assert seen == {("once waited", k) for k in ONCE_WAITED} | {("early", k) for k in EARLY_READERS}


def _check_waits_first(kernel: ast.FunctionDef, body: list[ast.stmt]) -> None:
    """The rules of dependent_launch on a kernel's body (its own statements, branches on constexprs taken)."""
    assert _call_name(body[0]) == "allow_dependents", f"{kernel.name}: allow_dependents(PDL) must come first"
    waits = [i for i, s in enumerate(body) if _call_name(s) == "wait_for_inputs"]
    assert len(waits) == 1, f"{kernel.name}: one wait_for_inputs(PDL) in the kernel's own body, got {waits}"
    constexprs = {a.arg for a in kernel.args.args if a.annotation is not None}
    params = {a.arg for a in kernel.args.args} - constexprs
    early = (_names_read(body[: waits[0]]) & params) - WEIGHTS[kernel.name]
    assert not early, f"{kernel.name} reads {sorted(early)} before wait_for_inputs (not weights)"


# ---- CPU: the trigger by decode rows (PDL_TRIGGERS_BY_ROWS), its overrides, static_decode's contexts -------

BLOCK_SIZE, STEPS = 16, 16
CUDA = torch.device("cuda", 0)
# a table whose every entry differs from the others and from the default outside a decode step ("start")
DISTINCT_TABLE = ((1, "exit"), (3, "wait"), (None, "off"))


@pytest.fixture
def pdl_hardware(monkeypatch):
    """launch_options as on a Hopper GPU (compute capability 9 faked), the distinct table, no env override."""
    from tierlm.kernels import dependent_launch

    monkeypatch.setattr(dependent_launch, "_compute_capability", lambda index: 9)
    monkeypatch.setattr(dependent_launch, "PDL_TRIGGERS_BY_ROWS", DISTINCT_TABLE)
    monkeypatch.delenv("TIERLM_NO_PDL", raising=False)
    monkeypatch.delenv("TIERLM_PDL_TRIGGER", raising=False)
    return dependent_launch


def test_the_table_names_a_trigger_for_every_row_count():
    from tierlm.kernels.dependent_launch import PDL_TRIGGERS_BY_ROWS, TRIGGERS

    bounds = [bound for bound, _ in PDL_TRIGGERS_BY_ROWS]
    assert bounds[-1] is None and all(b is not None for b in bounds[:-1]), bounds
    assert bounds[:-1] == sorted(bounds[:-1]), bounds
    assert all(trigger in TRIGGERS for _, trigger in PDL_TRIGGERS_BY_ROWS)


def test_launch_options_take_the_tables_trigger_inside_a_decode_step(pdl_hardware):
    options, rows_of = pdl_hardware.launch_options, pdl_hardware.decode_step_rows
    assert options(CUDA) == {"PDL": 3, "launch_pdl": True}  # outside a decode step: DEFAULT_TRIGGER
    expected = {1: (1, True), 2: (2, True), 3: (2, True), 4: (0, False), 64: (0, False)}
    for rows, (value, launch) in expected.items():
        with rows_of(rows):
            assert options(CUDA) == {"PDL": value, "launch_pdl": launch}, rows
    with rows_of(1):
        with rows_of(4):  # the innermost step counts; leaving it restores the outer one
            assert options(CUDA)["PDL"] == 0
        assert options(CUDA)["PDL"] == 1
    assert options(CUDA)["PDL"] == 3
    with rows_of(1):
        assert options(torch.device("cpu")) == {"PDL": 0, "launch_pdl": False}  # never on the CPU


def test_environment_overrides_the_table(pdl_hardware, monkeypatch):
    options, rows_of = pdl_hardware.launch_options, pdl_hardware.decode_step_rows
    monkeypatch.setenv("TIERLM_PDL_TRIGGER", "wait")
    for rows in (1, 4):
        with rows_of(rows):
            assert options(CUDA) == {"PDL": 2, "launch_pdl": True}, rows
    assert options(CUDA)["PDL"] == 2
    monkeypatch.setenv("TIERLM_PDL_TRIGGER", "sometimes")
    with rows_of(1), pytest.raises(ValueError, match="sometimes"):
        options(CUDA)
    monkeypatch.delenv("TIERLM_PDL_TRIGGER")
    monkeypatch.setenv("TIERLM_NO_PDL", "1")
    for rows in (1, 2):
        with rows_of(rows):
            assert options(CUDA) == {"PDL": 0, "launch_pdl": False}, rows


@pytest.fixture(scope="module")
def tiny_cpu_model(tmp_path_factory):
    from tierlm.demo_model import demo_config
    from tierlm.model.loader import load_model

    folder = tmp_path_factory.mktemp("demo_tiny")
    (folder / "config.json").write_text(json.dumps(demo_config("tiny", 512, eos_token_id=1)))
    return load_model(folder, dtype="float32", device="cpu", load_format="dummy")


def _runner(model, config, rows_per_request: int):
    from tierlm.model.model_cache import ModelCache
    from tierlm.model.static_decode import StaticDecodeRunner

    cache = ModelCache(config, 4 * rows_per_request, 4 * 4, BLOCK_SIZE, torch.float32, "cpu")
    return StaticDecodeRunner(model, cache, 4, 4, "eager", sizes=[1, 2, 4], widths=[4],
                              rows_per_request=rows_per_request)


def _recording(seen: list):
    """A step that records (its rows, the PDL value a kernel launched on a GPU would take) and does nothing."""
    from tierlm.kernels.dependent_launch import launch_options

    def step(batch, cache):
        seen.append((batch.token_ids.shape[0], launch_options(CUDA)["PDL"]))
        return torch.zeros(1)
    return step


@pytest.mark.parametrize("rows_per_request", [1, 2])
def test_capture_launches_each_shape_as_a_step_of_its_rows(pdl_hardware, tiny_cpu_model, monkeypatch,
                                                          rows_per_request):
    """`_capture` (CUDA's stream and graph calls faked: the step only records) warms up and captures each
    shape inside decode_step_rows(size x rows_per_request)."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    class Graph:
        def pool(self):
            return None

    stream = SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: nullcontext())
    model, config = tiny_cpu_model
    runner, seen = _runner(model, config, rows_per_request), []
    graphs, outputs = {}, {}
    runner._capture(_recording(seen), graphs, outputs)
    assert set(graphs) == {(1, 4), (2, 4), (4, 4)}
    trigger = {1: 1, 2: 2, 3: 2}  # DISTINCT_TABLE as PDL values; more rows: 0
    expected = [(size * rows_per_request, trigger.get(size * rows_per_request, 0))
                for size in (4, 2, 1) for _ in range(3)]  # largest first; two warm-up forwards, one captured
    assert seen == expected


def test_eager_steps_launch_as_steps_of_their_rows(pdl_hardware, tiny_cpu_model):
    model, config = tiny_cpu_model
    runner, seen = _runner(model, config, 1), []
    runner.forward = _recording(seen)
    for n in (1, 2, 3):
        runner.run_decode([5] * n, [0] * n, list(range(n)), [[i] for i in range(n)])
    assert seen == [(1, 1), (2, 2), (4, 0)]  # 3 rows run at the prepared size 4
    from tierlm.kernels.dependent_launch import launch_options

    assert launch_options(CUDA)["PDL"] == 3  # after the steps: the default again


# ---- GPU: decode and verification graphs with and without PDL, bit for bit --------------------------------


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


@pytest.mark.skipif(not _pdl_on_here(), reason="PDL runs on CUDA devices of compute capability 9+ only")
def test_graphs_under_a_mixed_table_equal_those_without_pdl(small_model, monkeypatch):
    """Each trigger the table may choose, taken by the graphs of the batch size it names (batch 1 "wait",
    batch 4 "exit", verification steps of 4 x 3 rows "start"), gives the logits of graphs without PDL."""
    from tierlm.kernels import dependent_launch

    model, config = small_model
    monkeypatch.delenv("TIERLM_PDL_TRIGGER", raising=False)
    monkeypatch.setattr(dependent_launch, "PDL_TRIGGERS_BY_ROWS", ((1, "wait"), (4, "exit"), (None, "start")))
    for batch, rows in ((1, 1), (4, 1), (4, 3)):
        monkeypatch.setenv("TIERLM_NO_PDL", "1")
        without = greedy_logits(model, config, batch, rows)
        monkeypatch.delenv("TIERLM_NO_PDL")
        assert torch.equal(greedy_logits(model, config, batch, rows), without), (batch, rows)
