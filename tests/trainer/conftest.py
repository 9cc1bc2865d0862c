"""Fixtures of the trainer tests: the tiny Qwen3 shape and a Trainer factory."""

from pathlib import Path

import pytest
import torch

from torchtitan_rl.config.job_config import ModelConfig, TrainerConfig
from torchtitan_rl.models.families import resolve_shape
from torchtitan_rl.models.shape import ModelShape
from torchtitan_rl.trainer import Trainer

from .helpers import VOCAB


@pytest.fixture(scope="session")
def shape() -> ModelShape:
    return resolve_shape(flavor="tiny", hf_checkpoint=None, vocab_size=VOCAB, max_seq_len=64)


@pytest.fixture
def make_trainer(shape, tmp_path):
    """Trainer factory: TrainerConfig fields as keyword overrides, output in tmp_path."""

    def make(*, seed: int = 0, output_dir: Path | None = None, model_config=None, **fields):
        return Trainer(
            TrainerConfig(**fields),
            model_config=model_config or ModelConfig(),
            shape=shape,
            seed=seed,
            device=torch.device("cpu"),
            output_dir=output_dir or tmp_path,
        )

    return make
