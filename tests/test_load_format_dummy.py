"""`--load-format dummy`: random weights from config.json alone, the very values `tierlm demo-model` writes."""

import shutil

import pytest
import torch

from tierlm.cli import main as cli_main
from tierlm.demo_model import build_demo_model
from tierlm.model.loader import CheckpointError, load_model


@pytest.fixture(scope="module")
def demo_model_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("demo") / "tiny", "tiny")


def test_dummy_weights_equal_the_demo_checkpoint(demo_model_dir):
    loaded, _ = load_model(demo_model_dir, device="cpu")
    dummy, _ = load_model(demo_model_dir, device="cpu", load_format="dummy")
    expected = dict(loaded.named_parameters())
    drawn = dict(dummy.named_parameters())
    assert drawn.keys() == expected.keys()
    different = [name for name, value in drawn.items() if not torch.equal(value, expected[name])]
    assert not different, f"dummy weights differ from the demo checkpoint's: {different[:3]}"


def test_dummy_needs_only_config_and_tokenizer(demo_model_dir, tmp_path, capsys):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(demo_model_dir / name, tmp_path / name)
    with pytest.raises(CheckpointError):
        load_model(tmp_path, device="cpu")
    model, config = load_model(tmp_path, device="cpu", load_format="dummy")
    assert next(model.parameters()).device.type == "cpu" and config.vocab_size == model.lm_head.weight.shape[0]
    command = ["generate", str(tmp_path), "--prompt", "def f(x):", "--max-tokens", "4", "--temperature", "0",
               "--device", "cpu"]
    assert cli_main(command) == 2
    assert "safetensors" in capsys.readouterr().err
    assert cli_main([*command, "--load-format", "dummy"]) == 0
    assert "tokens=4" in capsys.readouterr().err


def test_unknown_load_format_is_refused(demo_model_dir):
    with pytest.raises(CheckpointError, match="load_format: unknown 'npz'"):
        load_model(demo_model_dir, device="cpu", load_format="npz")
