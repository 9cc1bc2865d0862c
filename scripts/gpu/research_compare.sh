#!/bin/bash
# The research-surface comparison on one GPU (docs/benchmarks.md, "GRPO recipes on SmolLM2 math"):
# today's default run_configs/smollm2_135m_math.toml and the GRPO, Dr. GRPO and DAPO presets, 100 steps
# each, all four at once (a 135M model leaves the H100 mostly idle), held-out accuracy every 25 steps.
#   bash scripts/gpu/research_compare.sh start     # launch (setsid: they outlive the device call)
#   bash scripts/gpu/research_compare.sh status    # progress; copies metrics to $OUT
# Every run gets the same overrides: eval every 25 steps, 15% of the GPU memory for each vLLM engine,
# micro-batches of 16 rows (four trainers share the GPU), no checkpoints.
set -u
cd "$(dirname "$0")/../.."
RUNS=/tmp/research
NAMES="default grpo drgrpo dapo"
config() { [ "$1" = default ] && echo run_configs/smollm2_135m_math.toml || echo "run_configs/smollm2_135m_math_$1.toml"; }
case ${1:-status} in
  start)
    python3 -m torchtitan_rl.models.fetch smollm2-135m-instruct --out models/smollm2-135m-instruct || exit 1
    mkdir -p $RUNS
    for name in $NAMES; do
      date -u +%s > $RUNS/$name.start
      setsid nohup python3 -m torchtitan_rl.simple_grpo --config "$(config $name)" --job.output_dir $RUNS/$name \
        --eval.every_n_steps ${EVAL_EVERY:-25} --generator.gpu_memory_utilization ${GPU_MEM:-0.15} --trainer.checkpoint.no-enable \
        --trainer.micro_batch_size ${MICRO:-16} \
        > $RUNS/$name.log 2>&1 < /dev/null &
      sleep ${STAGGER:-25}  # vLLM profiles free memory at start: one engine at a time
    done
    ;;
  status)
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
    for name in $NAMES; do
      steps=$(grep -c '"reward_mean"' $RUNS/$name/metrics.jsonl 2>/dev/null)
      echo "== $name: ${steps:-0} steps, $(( $(date -u +%s) - $(cat $RUNS/$name.start) )) s"
      grep eval_accuracy $RUNS/$name/metrics.jsonl 2>/dev/null | cut -c1-160
      tail -c 400 $RUNS/$name.log | tr '\r' '\n' | tail -2
      if [ -n "${OUT:-}" ]; then mkdir -p $OUT/$name; cp $RUNS/$name/metrics.jsonl $RUNS/$name/samples.jsonl $OUT/$name/ 2>/dev/null; fi
    done
    ;;
esac
