# Partial rollouts as issue 39's GPU rows run them, for long_tail.sh (its "on" rows) and research_compare.sh (its
# "partial" run): over-sampling as many groups again as a step trains, tokens at most 2 versions old, per-token
# truncated importance weights (docs/benchmarks.md, "Partial rollouts on the CPU harness", says why these values).
PARTIAL_ON_ARGS="--grpo.partial.enable true --grpo.partial.over_sample 64 --grpo.partial.max_token_age 2 \
--grpo.importance_correction truncate"
