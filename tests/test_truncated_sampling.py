"""top_p / top_k sampling: vLLM reports logprobs of the truncated distribution, the trainer scores the full one.

The mismatch metric would then report a sync fault that is not one, so it is
left blank (NaN) on such runs; importance correction is refused by the config
(tests/config/test_config_cli.py).
"""

import gc
import math

import pytest

from tests.test_simple_grpo import _config
from torchtitan_rl import simple_grpo


@pytest.mark.slow
def test_truncated_sampling_leaves_the_mismatch_metric_blank(tmp_path):
    cfg = _config(tmp_path, steps=2)
    cfg.grpo.prompts_per_step = 8
    cfg.generator.sampling.top_k = 4  # of 16 tokens: every row cuts off real probability mass
    history = simple_grpo.train(cfg)
    gc.collect()
    assert len(history) == 2
    for record in history:
        assert all(math.isnan(record[k]) for k in ("mismatch_mean", "mismatch_max", "mismatch_frac_tokens")), record
        assert math.isfinite(record["loss"]) and math.isfinite(record["reward_mean"])
