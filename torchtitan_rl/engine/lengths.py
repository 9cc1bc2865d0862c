"""The timing harness's response lengths (grpo.harness_lengths): one seeded draw per sample.

A sample's length is a function of (request seed, global prompt index, sample index) only, as its sampling
seed is (engine.sample_seed), so a batch's lengths do not depend on how replicas or ranks split it.
"""

import math
import random
from statistics import NormalDist

from torchtitan_rl.config import HarnessLengthsConfig

P90_Z = NormalDist().inv_cdf(0.9)
"""The standard normal's 90th percentile (1.2816): a log-normal's p90 is median * exp(sigma * P90_Z)."""


def response_length(lengths: HarnessLengthsConfig, *, cap: int, seed: int, prompt: int, sample: int) -> int | None:
    """Tokens sample ``sample`` of prompt ``prompt`` of the request seeded ``seed`` runs to; None for
    ``fixed`` (the sample runs to ``cap`` = generator.sampling.max_tokens and may stop early).

    ``lognormal``: exp(mu + sigma * z), mu = ln(median), sigma = ln(p90 / median) / 1.2816, z a standard
    normal drawn by inverting its CDF at a uniform of a string-seeded ``random.Random`` (the same on every
    platform and Python version), rounded and clipped to [1, cap]: its median and p90 are the config's
    while cap > p90, and P(length = cap) = 1 - Phi(ln(cap / median) / sigma) of the samples sit at the cap
    (3.5% for the default 1500 / 5000 / 8192)."""
    if lengths.distribution == "fixed":
        return None
    assert lengths.distribution == "lognormal", lengths.distribution
    rng = random.Random(f"harness_lengths:{seed}:{prompt}:{sample}")
    u = (rng.getrandbits(53) + 0.5) / (1 << 53)  # in (0, 1): inv_cdf rejects 0
    sigma = math.log(lengths.p90 / lengths.median) / P90_Z
    return min(cap, max(1, round(lengths.median * math.exp(sigma * NormalDist().inv_cdf(u)))))
