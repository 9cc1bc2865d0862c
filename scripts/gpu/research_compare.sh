#!/bin/bash
# The research-surface comparison on one GPU (docs/benchmarks.md, "GRPO recipes on SmolLM2 math"):
# today's default run_configs/smollm2_135m_math.toml and the GRPO, Dr. GRPO, DAPO and GSPO presets, 100 steps
# each, all five at once (a 135M model leaves the GPU mostly idle), scored every 25 steps on the task's
# held-out set (500 problems) and on the named set word_problems (64 hand-written problems, not from the
# training generator; [[eval.sets]] in every preset).
#   bash scripts/gpu/research_compare.sh start     # launch (setsid: they outlive the device call)
#   bash scripts/gpu/research_compare.sh status    # progress and the table; copies metrics to $OUT
#   bash scripts/gpu/research_compare.sh evaluate  # after the runs: the standalone evaluator on the base model
#                                                  # and each run's export, word_problems -> $OUT/eval_<name>.json
# Every run gets the same overrides: eval every $EVAL_EVERY steps, $GPU_MEM of the GPU memory for each
# vLLM engine, micro-batches of $MICRO rows (five trainers share the GPU), no checkpoints but an export
# of the final policy to <run>/hf (python -m torchtitan_rl.evaluate --model <run>/hf scores it again).
# Each run writes $RUNS/<name>/run-N/ and the link $RUNS/<name>/latest; status reads latest/.
set -u
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-/tmp/research}
NAMES=${NAMES:-default grpo drgrpo dapo gspo}
config() { [ "$1" = default ] && echo run_configs/smollm2_135m_math.toml || echo "run_configs/smollm2_135m_math_$1.toml"; }
case ${1:-status} in
  start)
    python3 -m torchtitan_rl.fetch smollm2-135m-instruct --out models/smollm2-135m-instruct || exit 1
    mkdir -p "$RUNS"
    for name in $NAMES; do
      date -u +%s > "$RUNS/$name.start"
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
      setsid nohup python3 -m torchtitan_rl.simple_grpo --config "$(config "$name")" --job.output_dir "$RUNS/$name" \
        --trainer.steps "${STEPS:-100}" --eval.every_n_steps "${EVAL_EVERY:-25}" \
        --generator.gpu_memory_utilization "${GPU_MEM:-0.10}" --trainer.checkpoint.no-enable \
        --trainer.micro_batch_size "${MICRO:-8}" --job.export \
        > "$RUNS/$name.log" 2>&1 < /dev/null &
      sleep "${STAGGER:-25}"  # vLLM profiles free memory at start: one engine at a time
    done
    ;;
  status)
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
    for name in $NAMES; do
      run="$RUNS/$name/latest"
      started=$(cat "$RUNS/$name.start" 2>/dev/null || date -u +%s)
      echo "== $name: $(( $(date -u +%s) - started )) s since start"
      [ -f "$RUNS/$name.log" ] && tail -c 400 "$RUNS/$name.log" | tr '\r' '\n' | tail -2
      if [ -n "${OUT:-}" ] && [ -f "$run/metrics.jsonl" ]; then
        mkdir -p "$OUT/$name"; cp "$run/metrics.jsonl" "$run/config.toml" "$OUT/$name/"
        [ -f "$run/samples.jsonl" ] && cp "$run/samples.jsonl" "$OUT/$name/"
      fi
    done
    python3 scripts/gpu/research_table.py --runs "$RUNS" $NAMES | tee ${OUT:+"$OUT/table.md"}
    ;;
  evaluate)
    set -o pipefail
    words=torchtitan_rl/grpo/tasks/data/word_problems_eval.jsonl
    dest=${OUT:-$RUNS}
    score() { python3 -m torchtitan_rl.evaluate --model "$1" --set "word_problems=$words" --max-tokens 256 \
                --max-model-len 512 --gpu-memory-utilization "${GPU_MEM:-0.10}" --out "$dest/eval_$2.json" 2>&1 | grep torchtitan_rl; }
    score models/smollm2-135m-instruct base
    for name in $NAMES; do
      if [ -f "$RUNS/$name/latest/hf/model.safetensors" ]; then score "$RUNS/$name/latest/hf" "$name"; else echo "== $name: no export yet"; fi
    done
    ;;
  *) echo "usage: $0 start|status|evaluate" >&2; exit 2 ;;
esac
