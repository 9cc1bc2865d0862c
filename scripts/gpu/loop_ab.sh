#!/bin/bash
# Issue 41: the mission step's generate, old code against this tree on one warm machine (the H100's 7.97 s vs 6.74 s
# were two leases apart). Rows, run in the order given (LOOP_AB_ROWS), each LOOP_AB_STEPS steps (8) on GPU 0:
#   before       the tree in $LOOP_AB_BEFORE (a copy of 3a2b0a6: main before the long-tail trace) with its own config
#   after        this tree, run_configs/qwen3_0.6b.toml as written (compiled decoder, job.host_threads 0)
#   threads_off  this tree, --job.host_threads -1 (torch's and vLLM's own thread defaults, as before job.host_threads)
#   eager        this tree, --generator.compile false (the decoder as before compile became the default)
#   batched      this tree, --generator.seeded_noise batched (every seeded row's noise in one kernel, not one each;
#                on this dense config vLLM 0.26's model runner V2 does that already: the same samples, the run says so)
#   threads4     this tree, --job.host_threads 4 (the default gives one process of a 16-core one-GPU host all 16: its
#                OpenMP pool then spins on the cores the engine's own thread needs after every CPU op)
#   passive      this tree with OMP_WAIT_POLICY=PASSIVE (OpenMP threads sleep instead of spinning when idle)
#   recompute    this tree, --grpo.old_logprobs recompute (pi_old by a recompute of the batch, as before the
#                config took it from the training forward)
#   loop_threads1  this tree, --generator.loop_threads 1 (torch's intra-op pool at one thread while the engine loop
#                runs: vLLM >= 0.32's serving rule; the default 0 keeps job.host_threads's count). Raw files named
#                loop_threads0 are of the days when 1 was the default and this row set 0.
# LOOP_AB_GPU picks the GPU (default 0).
# Prints the host's thread facts (affinity, cgroup quota, NVML GPUs, torch's default) and one line per row: median
# step, median/min/max generate, median train over the steps after the first; raw metrics to $OUT/loop_ab_<row>.jsonl.
# Before the device call, here: mkdir -p before41 && git archive 3a2b0a6 torchtitan_rl run_configs | tar -x -C before41
# LOOP_AB_CONFIG (qwen3_0.6b.toml) and LOOP_AB_ARGS are for a CPU rehearsal (cpu_tiny.toml).
set -u
OUT=${OUT:-/tmp/loop_ab_out}
mkdir -p "$OUT"
before=${LOOP_AB_BEFORE:-before41}
config=${LOOP_AB_CONFIG:-qwen3_0.6b.toml}
steps=${LOOP_AB_STEPS:-8}
# shellcheck disable=SC2206
extra=(${LOOP_AB_ARGS:-})
python3 - <<'PY'
import os, torch
from torchtitan_rl.distributed.threads import host_gpu_count, usable_cpus
try:
    quota = open("/sys/fs/cgroup/cpu.max").read().strip()
except OSError:
    quota = "none"
print(f"threads: affinity {len(os.sched_getaffinity(0))} cores, cgroup cpu.max '{quota}', usable {usable_cpus()}, "
      f"NVML GPUs {host_gpu_count()}, torch default {torch.get_num_threads()}, OMP_NUM_THREADS "
      f"{os.environ.get('OMP_NUM_THREADS')}")
PY

row() {  # NAME DIR [simple_grpo overrides...]
  local name=$1 dir=$2; shift 2
  local tmp; tmp=$(mktemp -d /tmp/loop_ab_XXXX)
  echo "=== $name ($(date -u +%H:%M:%S))"
  (cd "$dir" && CUDA_VISIBLE_DEVICES=${LOOP_AB_GPU:-0} PYTHONPATH="$PWD:${PYTHONPATH:-}" python3 -m torchtitan_rl.simple_grpo \
    --config "run_configs/$config" --trainer.steps "$steps" --job.output_dir "$tmp" \
    --trainer.checkpoint.enable false "$@" "${extra[@]}" 2>&1 | grep -i -E "torch threads|OMP_NUM|mean reward|Error" )
  cp "$(find "$tmp" -name metrics.jsonl | head -n 1)" "$OUT/loop_ab_$name.jsonl" || echo "$name: no metrics"
  python3 - "$OUT/loop_ab_$name.jsonl" "$name" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])][1:]  # step 0 holds the compile and warm-up
gen = [r["generate_s"] for r in rows]
print(f"{sys.argv[2]}: {len(rows)} steps, step {statistics.median(r['step_s'] for r in rows):.2f} s, generate median "
      f"{statistics.median(gen):.2f} (min {min(gen):.2f}, max {max(gen):.2f}) s, train "
      f"{statistics.median(r['train_s'] for r in rows):.2f} s; generate per step {[round(g, 2) for g in gen]}")
PY
}

for name in ${LOOP_AB_ROWS:-before after}; do
  case $name in
    before)      row before "$before" ;;
    after)       row after . --generator.compile_cache_dir /tmp/loop_ab_cache ;;
    threads_off) row threads_off . --generator.compile_cache_dir /tmp/loop_ab_cache --job.host_threads -1 ;;
    eager)       row eager . --generator.compile false ;;
    batched)     row batched . --generator.compile_cache_dir /tmp/loop_ab_cache --generator.seeded_noise batched ;;
    threads4)    row threads4 . --generator.compile_cache_dir /tmp/loop_ab_cache --job.host_threads 4 ;;
    passive)     OMP_WAIT_POLICY=PASSIVE row passive . --generator.compile_cache_dir /tmp/loop_ab_cache ;;
    recompute)   row recompute . --generator.compile_cache_dir /tmp/loop_ab_cache --grpo.old_logprobs recompute ;;
    loop_threads1) row loop_threads1 . --generator.compile_cache_dir /tmp/loop_ab_cache --generator.loop_threads 1 ;;
    *)           echo "unknown row $name" ;;
  esac
done
