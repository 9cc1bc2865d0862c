"""The research fields: presets load and validate; impossible values name their field."""

import dataclasses
from pathlib import Path

import pytest

from torchtitan_rl.config import JobConfig, load_toml, validate

REPO = Path(__file__).resolve().parents[2]


def test_presets_differ_from_the_default_only_in_grpo():
    default = load_toml(REPO / "run_configs/smollm2_135m_math.toml")
    seen = {}
    for name in ("grpo", "drgrpo", "dapo", "gspo"):
        cfg = load_toml(REPO / f"run_configs/smollm2_135m_math_{name}.toml")
        validate(cfg)
        assert dataclasses.replace(cfg, grpo=default.grpo, job=default.job) == default, name
        g = cfg.grpo
        seen[name] = (g.loss_aggregation, g.advantage_norm, g.ratio_level, g.clip_eps_low, g.clip_eps_high,
                      g.kl_coef, g.importance_correction, g.dynamic_sampling, g.overlong, g.mini_batches)
    assert seen == {
        # GRPO as published: the k3 KL to the initial policy at 0.04.
        "grpo": ("seq_mean_token_mean", "group_std", "token", 0.2, 0.2, 0.04, "off", False, "off", 2),
        "drgrpo": ("seq_mean_token_sum_norm", "none", "token", 0.2, 0.2, 0.0, "off", False, "off", 2),
        "dapo": ("token_mean", "group_std", "token", 0.2, 0.28, 0.0, "off", True, "soft_penalty", 2),
        # GSPO: the paper's sequence-level clip range and a sequence-level off-policy correction.
        "gspo": ("seq_mean_token_mean", "group_std", "sequence", 3e-4, 4e-4, 0.0, "truncate", False, "off", 2),
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
