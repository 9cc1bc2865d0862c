"""The research fields: presets load and validate; impossible values name their field."""

import dataclasses
from pathlib import Path

import pytest

from torchtitan_rl.config import JobConfig, load_toml, validate

REPO = Path(__file__).resolve().parents[2]


def test_presets_differ_from_the_default_only_in_grpo():
    default = load_toml(REPO / "run_configs/smollm2_135m_math.toml")
    seen = {}
    for name in ("grpo", "drgrpo", "dapo"):
        cfg = load_toml(REPO / f"run_configs/smollm2_135m_math_{name}.toml")
        validate(cfg)
        assert dataclasses.replace(cfg, grpo=default.grpo, job=default.job) == default, name
        seen[name] = (cfg.grpo.loss_aggregation, cfg.grpo.advantage_norm, cfg.grpo.clip_eps_high,
                      cfg.grpo.dynamic_sampling, cfg.grpo.overlong, cfg.grpo.mini_batches)
    assert seen == {
        "grpo": ("seq_mean_token_mean", "group_std", 0.2, False, "off", 2),
        "drgrpo": ("seq_mean_token_sum_norm", "none", 0.2, False, "off", 2),
        "dapo": ("token_mean", "group_std", 0.28, True, "soft_penalty", 2),
    }


@pytest.mark.parametrize("field, value, expected", [
    ("epochs", 0, "grpo.epochs: must be >= 1, got 0"),
    ("mini_batches", 0, "grpo.mini_batches: must be >= 1, got 0"),
    ("entropy_coef", -0.1, "grpo.entropy_coef: must be >= 0"),
    ("overlong_buffer", 9, "grpo.overlong_buffer: must be in [1, generator.sampling.max_tokens 8], got 9"),
    ("dynamic_sampling_max_rounds", 0, "grpo.dynamic_sampling_max_rounds: must be >= 1, got 0"),
])
def test_impossible_research_values_name_their_field(field, value, expected):
    cfg = JobConfig()
    cfg.grpo.overlong, cfg.grpo.dynamic_sampling = "soft_penalty", True
    setattr(cfg.grpo, field, value)
    with pytest.raises(ValueError) as err:
        validate(cfg)
    assert str(err.value).startswith(expected)
