"""kernels/mtp_input: the MTP draft head's layer input (two Gemma norms, fc_embedding / fc_hidden, the
embedding added to every stream) in one launch, against the torch reference, under TRITON_INTERPRET=1 on
CPU at small shapes (compiled on a GPU, at the real width too). The reference is first checked equal, bit
for bit, to the module's own torch path (`MultiTokenPredictor.layer_input`). The kernel sums its products
in another order: fp32 within 1e-5; bf16 within a unit of the last place (`assert_close`)."""

from __future__ import annotations

import pytest
import torch
from interpreted import on_cuda_else_interpreted
from reference_models import BASE

from tierlm.kernels.mtp_input import naive


def head(hidden: int, dtype: torch.dtype, seed: int = 0):
    """A draft head with random input weights (norm weights around 0, as Gemma norms store them)."""
    from tierlm.config import ModelConfig
    from tierlm.model.checkpoint_layout import MTPLayout
    from tierlm.model.mtp import MultiTokenPredictor

    config = ModelConfig.from_dict({**BASE, "hidden_size": hidden})
    module = MultiTokenPredictor(config, MTPLayout())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for linear in (module.fc_embedding, module.fc_hidden):
            linear.weight.copy_(torch.randn(hidden, hidden, generator=gen) / hidden**0.5)
        for norm in (module.pre_fc_norm_embedding, module.pre_fc_norm_hidden):
            norm.weight.copy_(0.1 * torch.randn(norm.weight.shape, generator=gen))
    return module.to(dtype)


def reference_args(module, rows: int, seed: int = 1) -> tuple:
    """Inputs of `rows` rows (one row 100x larger: the norms must scale it) and the module's weights, in the
    module's dtype."""
    gen = torch.Generator().manual_seed(seed)
    h, hc = module.hidden_size, module.hc_count
    dtype = module.fc_hidden.weight.dtype
    embeddings = torch.randn(rows, h, generator=gen)
    hidden = torch.randn(rows, hc * h, generator=gen)
    hidden[0] *= 100.0
    return (embeddings.to(dtype), hidden.to(dtype), module.pre_fc_norm_embedding.weight.detach(),
            module.pre_fc_norm_hidden.weight.detach(), module.pre_fc_norm_hidden.eps,
            module.fc_embedding.weight.detach(), module.fc_hidden.weight.detach())


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: within 1e-5; bf16: within one unit of the last place of the values and of the row's largest
    (a product rounded the other way moves the sum by up to one unit of the product, which can exceed the
    sum's own)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        return
    got, expected = got.float(), expected.float()
    bound = 2.0**-7 * (expected.abs() + expected.abs().amax(dim=1, keepdim=True))
    assert torch.all((got - expected).abs() <= bound), (got - expected).abs().max().item()


def compare(device: str, hidden: int = 40) -> None:
    """Hidden sizes that are (and are not) a whole number of tiles, 1 to 5 rows, fp32 and bf16."""
    from tierlm.kernels.mtp_input import triton as kernels

    for dtype in (torch.float32, torch.bfloat16):
        for width in (hidden, 2 * kernels.BLOCK_K):
            module = head(width, dtype)
            for rows in (1, 2, 5):
                args = reference_args(module, rows)
                expected = naive.mtp_layer_input(*args)
                on_device = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
                assert_close(kernels.mtp_layer_input(*on_device).cpu(), expected)


INTERPRETED_EARLY = {  # (queued when collection ends, see tests/interpreted.py)
    # K and statistics steps of 16 values: hidden 40 in three steps (the last part-full), 2 * BLOCK_K = 32
    # in two whole ones (the shipped 256-value steps at 512 columns cost the interpreter 40 s: 64 programs
    # a row)
    "test_kernel_matches_reference": (("import tierlm.kernels.mtp_input.triton as k; k.BLOCK_K = k.STATS_BLOCK = 16\n"
                                       "import test_mtp_input_kernel as t; t.compare('cpu')"),),
}


def test_kernel_matches_reference():
    on_cuda_else_interpreted(lambda: compare("cuda"), INTERPRETED_EARLY, "test_kernel_matches_reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_module_path(dtype):
    """naive.mtp_layer_input is what the draft head computes on its torch path, bit for bit."""
    module = head(64, dtype)
    args = reference_args(module, 3)
    assert torch.equal(naive.mtp_layer_input(*args), module.layer_input(args[0], args[1]))


def test_bad_arguments_are_named():
    module = head(16, torch.float32)
    args = list(reference_args(module, 2))
    with pytest.raises(ValueError, match="hidden streams must be"):
        naive.mtp_layer_input(args[0], args[1][:, :-1], *args[2:])
    with pytest.raises(ValueError, match="norm weights must be"):
        naive.mtp_layer_input(*args[:2], args[2][:-1], *args[3:])
    with pytest.raises(ValueError, match="fc weights must be"):
        naive.mtp_layer_input(*args[:5], args[5][:, :-1], args[6])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_input_takes_the_kernel_on_gpu(dtype, monkeypatch):
    """At the real width (hidden 2560, 4 streams) the module's CUDA path (the kernel, up to
    FUSED_INPUT_MAX_ROWS rows) matches its torch path (TIERLM_NO_FUSED_MTP_INPUT=1), and past that many
    rows it is the torch path."""
    from tierlm.model.mtp import FUSED_INPUT_MAX_ROWS

    module = head(2560, dtype).cuda()
    for rows in (2, FUSED_INPUT_MAX_ROWS + 1):
        embeddings, hidden = (a.cuda() for a in reference_args(module, rows)[:2])
        monkeypatch.delenv("TIERLM_NO_FUSED_MTP_INPUT", raising=False)
        assert module._fused_input_applies(embeddings) == (rows <= FUSED_INPUT_MAX_ROWS)
        fused = module.layer_input(embeddings, hidden)
        monkeypatch.setenv("TIERLM_NO_FUSED_MTP_INPUT", "1")
        assert not module._fused_input_applies(embeddings)
        assert_close(fused.cpu(), module.layer_input(embeddings, hidden).cpu())
