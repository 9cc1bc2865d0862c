#!/bin/bash
# Issue 41's rows (docs/benchmarks.md "One 80 GB GPU"), one name per row, run in the order given (ONE_GPU_ROWS):
#   mission        run_configs/qwen3_0.6b.toml on GPU 0, 14 steps (generator.compile on by default), the compile cache
#                  empty (a fresh generator.compile_cache_dir): the median step, the start, the exit after the last line
#   mission_again  the same command again, 6 steps, the cache the run above left: the second start
#   colocated2     the same config under python -m torchtitan_rl.launch on GPUs 0-1 (every rank colocated), 14 steps
#   host_before    two one-GPU runs of the config at once (GPUs 0 and 1) and one alone (GPU 0), 8 steps each, with
#                  --job.host_threads -1 (torch's and vLLM's own thread defaults: the code before this issue)
#   host_after     the same with the default job.host_threads 0 (cores / processes sharing them)
#   4B_auto        Qwen3-4B layout a on GPU 0 as the README runs it: job.fit auto picks what fits
#   4B_hand        Qwen3-4B layout a, --generator.sleep weights --trainer.master_dtype bfloat16 --job.fit off
#   8B_auto        Qwen3-8B layout b on GPUs 0-1, job.fit auto
#   8B_weights     Qwen3-8B layout b, sleep weights, bfloat16 masters, job.fit off (the sleep-cost pair: sync_s)
#   8B_kv_cache    Qwen3-8B layout b, sleep kv_cache, bfloat16 masters, job.fit off
#   8B_off         Qwen3-8B layout b, no sleep, bfloat16 masters, job.fit off (the estimate may refuse it: a row too)
#   offload        Qwen3-1.7B layout a with and without --trainer.cpu_offload true (job.fit off): its step cost
# ONE_GPU_CONFIG (run_configs/qwen3_0.6b.toml) and ONE_GPU_ARGS (simple_grpo args added to every row) are for a
# rehearsal on CPU with a stand-in nvidia-smi: ONE_GPU_ARGS=--dry-run checks every row's command line against the real
# config; ONE_GPU_CONFIG=run_configs/cpu_tiny.toml runs the mission rows through the tables.
# Rows on two GPUs need a machine of two (nvidia-h100-x2); on a card over 85 GB (an H200) every process is capped at
# 79.2 GiB (scripts/gpu/capped.py; ONE_GPU_CAP_GIB to change, 0 for none) and the row says so.
# Writes $OUT/mission_<row>.json + _metrics.jsonl, $OUT/sizes.jsonl (the size rows, scripts/gpu/sizes_row.py), and
# the section into $OUT/benchmarks.md (scripts/gpu/one_gpu_table.py, every earlier result file under
# scripts/gpu/results/one_gpu/ included). After the stash call of docs/gpu.md, e.g.:
#   run(kind="nvidia-h100-x1", carry=[".gpu/b"], command="source .gpu/b/install.sh && ONE_GPU_ROWS='mission mission_again' bash scripts/gpu/one_gpu.sh")
source "$(dirname "$0")/multi_gpu_env.sh"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
ngpu=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
cap=${ONE_GPU_CAP_GIB:-$([ "$total_mib" -gt 87000 ] && echo 79.2 || echo 0)}
capped=(); [ "$cap" != 0 ] && capped=(--cap-gib "$cap")
cache=/tmp/one_gpu_cache  # + the GPUs: generator.compile_cache_dir of every row (mission starts GPU 0's empty)
machine="$gpu x$ngpu"
config=${ONE_GPU_CONFIG:-run_configs/qwen3_0.6b.toml}
# shellcheck disable=SC2206
every=(${ONE_GPU_ARGS:-})
began=$(date +%s)  # a size row gets what is left of ONE_GPU_BUDGET_S (570: one device call), none under 90 s
echo "machine: $machine, ${total_mib} MiB a GPU, cap ${cap} GiB"
if [ "$cap" != 0 ]; then  # rows under a cap that does not hold would be neither card's numbers
  python3 scripts/gpu/capped.py --gib "$cap" --check ||
    { echo "CAP_CHECK_FAILED: ONE_GPU_CAP_GIB=0 runs uncapped"; exit 3; }
fi

mission() {  # NAME STEPS GPUS "MISSION_STEP_OPTIONS" [simple_grpo overrides...]
  local name=$1 steps=$2 gpus=$3 opts=$4; shift 4
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$gpus python3 scripts/gpu/mission_step.py --name "$name" --steps "$steps" --out "$OUT" $opts \
    --config "$config" "${capped[@]}" --env "ONE_GPU_MACHINE=$machine" -- \
    --generator.compile_cache_dir "$cache${gpus//,/}" --trainer.checkpoint.enable false "$@" "${every[@]}"
}

size() {  # TAG ROW [simple_grpo overrides...]
  local tag=$1 row=$2; shift 2
  SIZES_TAG=$tag SIZES_ROWS=$row SIZES_ARGS="--generator.compile_cache_dir $cache $* ${every[*]}" SIZES_STEPS=6 \
    SIZES_CONFIG=$config SIZES_BUDGET_S=$(( ${ONE_GPU_BUDGET_S:-570} - ($(date +%s) - began) )) \
    SIZES_CAP_GIB=$([ "$cap" != 0 ] && echo "$cap") bash scripts/gpu/sizes.sh
}

pair() {  # TAG HOST_THREADS: two one-GPU runs at once (each its own compile cache), then one alone
  local tag=$1 threads=$2
  mission "${tag}_pair0" 8 0 "" --job.host_threads "$threads" &
  local first=$!
  mission "${tag}_pair1" 8 1 "" --job.host_threads "$threads"
  wait $first
  mission "${tag}_alone" 8 0 "" --job.host_threads "$threads"
  rm -f "$OUT/mission_${tag}"_*_metrics.jsonl  # their per-step values are in the JSON: at most 8 files come back
}

for row in ${ONE_GPU_ROWS:-mission mission_again}; do
  echo "=== $row ($(date -u +%H:%M:%S))"
  case $row in
    mission)       rm -rf "${cache}0"; mission mission 14 0 "" ;;
    mission_again) mission mission_again 6 0 "" ;;
    colocated2)    mission colocated2 14 0,1 "--launch 2" ;;
    host_before)   pair host_before -1 ;;
    host_after)    pair host_after 0 ;;
    4B_auto)       size auto 4B:a:off ;;
    4B_hand)       size hand 4B:a:weights --trainer.master_dtype bfloat16 --job.fit off ;;
    8B_auto)       size auto 8B:b:off ;;
    8B_weights)    size hand 8B:b:weights --trainer.master_dtype bfloat16 --job.fit off ;;
    8B_kv_cache)   size hand 8B:b:kv_cache --trainer.master_dtype bfloat16 --job.fit off ;;
    8B_off)        size hand 8B:b:off --trainer.master_dtype bfloat16 --job.fit off ;;
    offload)       size no_offload 1.7B:a:off --job.fit off; size offload 1.7B:a:off --trainer.cpu_offload true --job.fit off ;;
    *)             echo "unknown row $row" ;;
  esac
done
python3 scripts/gpu/one_gpu_table.py --results "$OUT" scripts/gpu/results/one_gpu --write "$OUT/benchmarks.md"
