#!/bin/bash
# generator.sleep 'weights' (vLLM sleep level 2) changes nothing a run computes: run_configs/qwen3_0.6b.toml on one
# GPU (CUDA graphs on) for SLEEP_STEPS steps (20) without sleep and with it, then compare every step's metrics. Every
# sync after a level-2 wake rewrites and verifies all tensors (tests/engine/test_sleep.py proves the path on CPU);
# here the outputs after each wake (graph replay, prefix cache reset) must equal the run that never slept.
#   run(carry=[".gpu/b"], command="source .gpu/b/install.sh && bash scripts/gpu/sleep_equal.sh")
# Env: SLEEP_STEPS, SLEEP_ARGS (extra args for both runs, e.g. "--grpo.prompts_per_step 32"), SLEEP_GPU (0).
# Env: SLEEP_MODES ("off weights"; "" runs the check alone), SLEEP_CHECK (1; 0 skips the check). The check and the
# two runs together take ~9 min on an H100: two calls (SLEEP_MODES="" then SLEEP_CHECK=0) leave room.
# Writes $OUT/sleep_check.json, $OUT/sleep_equal.json (per metric: the largest |difference| over the steps),
# $OUT/sleep_<mode>.jsonl and $OUT/sleep_rows.jsonl (the sizes.sh row of each run).
source "$(dirname "$0")/multi_gpu_env.sh"
STEPS=${SLEEP_STEPS:-20}
work=$(mktemp -d /tmp/sleep.XXXXXX)
# shellcheck disable=SC2206
extra=(${SLEEP_ARGS:-})
# First the state machine on this GPU with vLLM's real sleep mode (scripts/gpu/sleep_check.py, ~1 min).
if [ "${SLEEP_CHECK:-1}" = 1 ]; then
  CUDA_VISIBLE_DEVICES="${SLEEP_GPU:-0}" timeout 200 python3 scripts/gpu/sleep_check.py --json "$OUT/sleep_check.json" \
    > "$work/check.log" 2>&1; echo "=== sleep_check: exit $?"; tail -n 1 "$work/check.log"
  [ -s "$OUT/sleep_check.json" ] || tail -n 80 "$work/check.log" > "$OUT/sleep_check_failed.log"
fi
for mode in ${SLEEP_MODES-off weights}; do
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$work/$mode.mem" &
  smi=$!
  start=$(date +%s)
  CUDA_VISIBLE_DEVICES="${SLEEP_GPU:-0}" timeout 280 python3 -m torchtitan_rl.simple_grpo --config run_configs/qwen3_0.6b.toml \
    --trainer.steps "$STEPS" --trainer.checkpoint.enable false --job.output_dir "$work/$mode" \
    --generator.sleep "$mode" "${extra[@]}" > "$work/$mode.log" 2>&1
  rc=$?
  kill $smi 2>/dev/null; wait $smi 2>/dev/null
  echo "=== sleep $mode: exit $rc after $(( $(date +%s) - start )) s"
  tr '\r' '\n' < "$work/$mode.log" | grep -v "^\s*$" | grep -E "torchtitan_rl:|Error" | tail -n 6
  [ $rc = 0 ] || tr '\r' '\n' < "$work/$mode.log" | tail -n 120 > "$OUT/sleep_${mode}_failed.log"
  cp "$work/$mode/latest/metrics.jsonl" "$OUT/sleep_$mode.jsonl" 2>/dev/null
  python3 scripts/gpu/sizes_row.py --output-dir "$work/$mode" --log "$work/$mode.log" --mem "$work/$mode.mem" \
    --row "0.6B:a:$mode" --exit-code $rc --first 3 --last $(( STEPS - 1 )) --gpus "${SLEEP_GPU:-0}" >> "$OUT/sleep_rows.jsonl"
done
[ -s "$OUT/sleep_off.jsonl" ] && [ -s "$OUT/sleep_weights.jsonl" ] && python3 - "$OUT/sleep_off.jsonl" "$OUT/sleep_weights.jsonl" > "$OUT/sleep_equal.json" <<'PY'
import json, sys
from pathlib import Path

runs = [[json.loads(l) for l in Path(p).read_text().splitlines() if '"step_s"' in l] for p in sys.argv[1:]]
off, on = runs
assert off and len(off) == len(on), (len(off), len(on))
keys = ("reward_mean", "loss", "grad_norm", "kl", "entropy", "mismatch_mean", "mismatch_max", "completion_tokens")
diff = {k: max(abs(a[k] - b[k]) for a, b in zip(off, on)) for k in keys if k in off[0]}
print(json.dumps({"steps": len(off), "max_abs_diff": diff, "bitwise_equal": all(v == 0 for v in diff.values())}))
PY
cat "$OUT/sleep_equal.json" "$OUT/sleep_rows.jsonl" 2>/dev/null
