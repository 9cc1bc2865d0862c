"""The timing harness's response lengths (grpo.harness_lengths): what the docstring promises."""

import statistics

import pytest

from torchtitan_rl.config import HarnessLengthsConfig, JobConfig, validate
from torchtitan_rl.config.validation import harness_lengths
from torchtitan_rl.engine.lengths import response_length


def test_default_lognormal_has_the_median_p90_and_cap_its_docstring_states():
    lengths = HarnessLengthsConfig(distribution="lognormal")
    draws = [response_length(lengths, cap=8192, seed=s, prompt=p, sample=j)
             for s in range(5) for p in range(500) for j in range(8)]
    assert (lengths.median, lengths.p90) == (1500, 5000)
    assert min(draws) >= 1 and max(draws) == 8192
    assert statistics.median(draws) == pytest.approx(1500, rel=0.03)
    assert statistics.quantiles(draws, n=10)[-1] == pytest.approx(5000, rel=0.04)
    assert sum(d == 8192 for d in draws) / len(draws) == pytest.approx(0.035, abs=0.006)  # 1 - Phi(1.808)


def test_a_sample_length_depends_only_on_request_prompt_and_sample():
    lengths = HarnessLengthsConfig(distribution="lognormal", median=6, p90=24)
    a = response_length(lengths, cap=48, seed=3, prompt=7, sample=2)
    assert a == response_length(lengths, cap=48, seed=3, prompt=7, sample=2)
    others = {response_length(lengths, cap=48, seed=s, prompt=p, sample=j) for s, p, j in
              [(4, 7, 2), (3, 8, 2), (3, 7, 3), (5, 1, 0), (6, 2, 1)]}
    assert len(others | {a}) > 1
    assert response_length(HarnessLengthsConfig(), cap=48, seed=3, prompt=7, sample=2) is None  # fixed


def test_harness_lengths_apply_to_the_random_weights_harness_only():
    cfg = JobConfig()
    cfg.grpo.harness_lengths.distribution = "lognormal"
    with pytest.raises(ValueError, match=r"^grpo.harness_lengths: 'lognormal' sets the timing harness"):
        validate(cfg)
    cfg.grpo.task_without_checkpoint = "digits"
    validate(cfg)
    assert harness_lengths(cfg) is cfg.grpo.harness_lengths
    cfg.model.hf_checkpoint = "/a/checkpoint"  # real weights: lengths as they come
    assert harness_lengths(cfg) is None
    cfg.model.hf_checkpoint = None
    cfg.grpo.harness_lengths.p90 = 1500
    with pytest.raises(ValueError, match=r"^grpo.harness_lengths.p90: must exceed"):
        validate(cfg)
