"""The vision side against transformers 5.19 (tiny random configs): the tower alone (fp32 equal to the
reference's, bf16 within transformers' own bf16 error), and the whole model with an image in the prompt."""

from __future__ import annotations

import pytest
import torch
from test_bf16_parity import assert_within_reference_error

from tierlm.config import VisionConfig
from tierlm.model.vision.tower import VisionTower

# two attention heads of head_dim 8 (two rotary frequencies per axis), a 4 x 4 learned position table
TINY_VISION = {
    "depth": 2, "hidden_size": 16, "num_heads": 2, "intermediate_size": 24, "patch_size": 2,
    "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64, "num_position_embeddings": 16,
}
# an image smaller than the position table and one larger than it, not square: the table is resampled
GRIDS = [(1, 2, 4), (1, 6, 8)]


def reference_tower(seed: int = 0):
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpVisionConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpVisionModel

    torch.manual_seed(seed)
    model = Qwen4ExpVisionModel(Qwen4ExpVisionConfig(**TINY_VISION)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def tierlm_tower(reference) -> VisionTower:
    tower = VisionTower(VisionConfig.from_dict(TINY_VISION, {})).eval()
    tower.load_state_dict(reference.state_dict())  # names mirror the checkpoint's `model.visual.*`
    return tower


def test_tower_matches_reference_fp32_and_bf16():
    reference = reference_tower()
    tower = tierlm_tower(reference)
    c = tower.config
    patches = torch.randn(sum(t * h * w for t, h, w in GRIDS), c.patch_values, generator=torch.Generator().manual_seed(1))
    grid_thw = torch.tensor(GRIDS)
    with torch.no_grad():
        expected = reference(patches, grid_thw=grid_thw).pooler_output
        ours = tower(patches, GRIDS)
        assert ours.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, c.out_hidden_size)
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
        theirs_bf16 = reference.to(torch.bfloat16)(patches.bfloat16(), grid_thw=grid_thw).pooler_output
        ours_bf16 = tower.to(torch.bfloat16)(patches.bfloat16(), GRIDS)
    assert_within_reference_error(ours_bf16, theirs_bf16, expected, "vision tower bf16")


def test_tower_rejects_patches_that_do_not_fit_the_grids():
    tower = VisionTower(VisionConfig.from_dict(TINY_VISION, {}))
    with pytest.raises(ValueError, match=r"patches: expected \[8, 24\]"):
        tower(torch.zeros(9, 24), [(1, 2, 4)])
