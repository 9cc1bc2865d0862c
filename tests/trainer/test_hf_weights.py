"""Real weights: a Hugging Face Qwen3 folder (safetensors + config.json) loads exactly."""

import json

import pytest
import safetensors.torch
import torch

from torchtitan_rl.config.job_config import ModelConfig
from torchtitan_rl.models.families import resolve_shape, to_hf
from torchtitan_rl.models.shape import build_titan_model


def _write_hf_checkpoint(shape, folder, *, seed: int) -> dict[str, torch.Tensor]:
    """A tiny HF-format checkpoint of a seeded model; returns the model's parameters."""
    model = build_titan_model(shape, seed=seed)
    hf_state = {k: v.contiguous() for k, v in to_hf(model.state_dict(), shape).items()}
    folder.mkdir()
    safetensors.torch.save_file(hf_state, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(shape.to_hf_config()))
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_hf_checkpoint_round_trip(make_trainer, shape, tmp_path):
    hf_dir = tmp_path / "hf"
    want = _write_hf_checkpoint(shape, hf_dir, seed=5)
    loaded_shape = resolve_shape(
        flavor="tiny", hf_checkpoint=str(hf_dir), vocab_size=0, max_seq_len=64
    )
    assert loaded_shape == shape

    trainer = make_trainer(seed=0, model_config=ModelConfig(hf_checkpoint=str(hf_dir)))

    got = {k: v.full_tensor() for k, v in trainer.model.named_parameters()}
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_hf_folder_without_weights_raises(make_trainer, shape, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(shape.to_hf_config()))
    with pytest.raises(ValueError, match="model.hf_checkpoint"):
        make_trainer(model_config=ModelConfig(hf_checkpoint=str(tmp_path)))
