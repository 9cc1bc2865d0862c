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


@pytest.mark.slow
def test_sharded_load_on_two_ranks_equals_the_whole_model_load(tiny_hf_checkpoint, tmp_path):
    """Each of 2 gloo ranks reads only its shards' rows (torch.distributed.checkpoint's HF reader); the
    parameters and buffers equal those of ranks that each read the whole checkpoint, tensor for tensor, for a
    transformers-built Qwen3 (untied) and Llama (tied, q/k permuted by the adapter)."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers import REPO, free_port, repo_env

    folders = [str(tiny_hf_checkpoint("qwen3")), str(tiny_hf_checkpoint("llama"))]
    worker = Path(__file__).with_name("hf_load_worker.py")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         str(worker), str(tmp_path), *folders],
        cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for i in range(len(folders)):
        got = torch.load(tmp_path / f"{i}.pt")
        assert got["sharded"].keys() == got["whole"].keys()
        for name, want in got["whole"].items():
            assert torch.equal(got["sharded"][name], want), (folders[i], name)
