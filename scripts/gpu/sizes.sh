#!/bin/bash
# The size table (docs/benchmarks.md "Sizes"; README "Which layout for my model and GPUs"): Qwen3 1.7B / 4B / 8B
# with random weights through the GRPO loop of run_configs/qwen3_0.6b.toml (--model.flavor), on one GPU and on two,
# with and without generator.sleep. One row = FLAVOR:LAYOUT:SLEEP, picked by SIZES_ROWS (space-separated):
#   layout a   one process on GPU 0 (trainer and engine colocated)
#   layout b   torchrun on 2 GPUs, colocated on both (generator.colocated_ranks all)
#   layout c   torchrun on 2 GPUs, 1 trainer rank + 1 generator rank (weight_sync.transport nccl; sleep must be off)
#   sleep      off | kv_cache | weights (generator.sleep)
# A row that does not fit is a row too: its exit code and the line that refused it (the pre-start estimate or
# CUDA's refusal, one line) are recorded.
# Env: SIZES_ROWS (default: the whole table, ~12 rows: split it over calls, a row is ~2-5 min), SIZES_STEPS (6;
# medians over steps 2..SIZES_STEPS-1), SIZES_ARGS (extra simple_grpo args for every row of the call, e.g.
# "--trainer.master_dtype bfloat16 --trainer.micro_batch_tokens 32768"), SIZES_BUDGET_S (the call's time, 570: a row
# gets what is left, and none under 90 s),
# SIZES_GPU_UTIL_C (generator.gpu_memory_utilization of layout c's own GPU, 0.85). SIZES_MEMORY_LOG=1 keeps each row's
# lines about memory (vLLM's profile at VLLM_LOGGING_LEVEL=DEBUG) in $OUT/sizes_<row>_memory.log.
# SIZES_CONFIG (run_configs/qwen3_0.6b.toml). SIZES_GPUS ("0,1": the GPUs a row uses; layout a the first) and
# SIZES_PORT (29561) let two of these share a machine of four GPUs. SIZES_CAP_GIB (e.g. 79.2) runs each process as on
# a GPU of that size (scripts/gpu/capped.py: an 80 GB row on an H200; the memory it holds beyond the cap is left out
# of the row's peaks). SIZES_TAG names the rows of the call (e.g.
# auto, hand) in sizes.jsonl. A PYTORCH_CUDA_ALLOC_CONF set for the call reaches every row; its args record it.
# Multi-GPU rows run under python -m torchtitan_rl.launch: one line when a rank fails.
# After the stash call of docs/gpu.md, each call under 10 minutes:
#   run(kind="nvidia-h100-x2", carry=[".gpu/b"], command="source .gpu/b/install.sh && SIZES_ROWS='4B:a:weights 4B:b:weights' bash scripts/gpu/sizes.sh")
# Writes $OUT/sizes.jsonl (one JSON line per row, appended), $OUT/sizes_<row>.log (the tail of a failed row's log)
# and samples every GPU's used memory with nvidia-smi every 0.5 s for the peak. At most 8 files come back: rows
# append to one file; failed logs are the others.
source "$(dirname "$0")/multi_gpu_env.sh"
STEPS=${SIZES_STEPS:-6}
ROWS=${SIZES_ROWS:-"1.7B:a:off 1.7B:a:weights 4B:a:off 4B:a:weights 8B:a:weights 1.7B:b:off 4B:b:off 4B:b:weights 8B:b:off 8B:b:weights 4B:c:off 8B:c:off"}
work=$(mktemp -d /tmp/sizes.XXXXXX)
gpus=${SIZES_GPUS:-0,1}  # two GPU indices; layout a takes the first (two sizes.sh may share a machine)
port=${SIZES_PORT:-29561}
began=$(date +%s)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
ngpu=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
for row in $ROWS; do
  IFS=: read -r flavor layout sleep <<< "$row"
  name=${row//:/_}
  args=(--generator.sleep "$sleep")
  grpo=(-m torchtitan_rl.simple_grpo)
  [ -n "${SIZES_CAP_GIB:-}" ] && grpo=(scripts/gpu/capped.py --gib "$SIZES_CAP_GIB" "${grpo[@]}")
  trainer_gpus=1; used=$gpus
  case $layout in
    a) launch=(env CUDA_VISIBLE_DEVICES="${gpus%%,*}" python3); used=${gpus%%,*} ;;
    b) launch=(env CUDA_VISIBLE_DEVICES="$gpus" python3 -m torchtitan_rl.launch --nproc-per-node 2 --master-port "$port")
       args+=(--generator.colocated_ranks all); trainer_gpus=2 ;;
    c) launch=(env CUDA_VISIBLE_DEVICES="$gpus" python3 -m torchtitan_rl.launch --nproc-per-node 2 --master-port "$port")
       args+=(--weight_sync.transport nccl --generator.gpu_memory_utilization "${SIZES_GPU_UTIL_C:-0.85}") ;;
    *) echo "unknown layout $layout in $row"; exit 2 ;;
  esac
  if [ "$layout" != a ] && [ "$ngpu" -lt 2 ]; then echo "=== $row: skipped, needs 2 GPUs"; continue; fi
  left=$(( ${SIZES_BUDGET_S:-570} - ($(date +%s) - began) - 15 ))
  if [ "$left" -lt 90 ]; then echo "=== $row: skipped, ${left} s left in this call"; continue; fi
  # shellcheck disable=SC2206
  extra=(${SIZES_ARGS:-})
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$work/$name.mem" &
  smi=$!
  start=$(date +%s)
  timeout "$left" "${launch[@]}" "${grpo[@]}" --config "${SIZES_CONFIG:-run_configs/qwen3_0.6b.toml}" \
    --model.flavor "$flavor" --trainer.steps "$STEPS" --trainer.checkpoint.enable false \
    --job.output_dir "$work/$name" --weight_sync.peer_timeout_s 300 "${args[@]}" "${extra[@]}" > "$work/$name.log" 2>&1
  rc=$?
  kill $smi 2>/dev/null; wait $smi 2>/dev/null
  echo "=== $row: exit $rc after $(( $(date +%s) - start )) s on $gpu"
  tr '\r' '\n' < "$work/$name.log" | grep -v "^\s*$" | grep -E "torchtitan_rl:|Error" | tail -n 6
  [ $rc = 0 ] || tr '\r' '\n' < "$work/$name.log" | grep -v "^\s*$" | tail -n 120 > "$OUT/sizes_$name.log"
  [ -z "${SIZES_MEMORY_LOG:-}" ] ||
    grep -iE "memory|kv cache" "$work/$name.log" | head -n 80 > "$OUT/sizes_${name}_memory.log"
  python3 scripts/gpu/sizes_row.py --output-dir "$work/$name" --log "$work/$name.log" --mem "$work/$name.mem" \
    --row "$row" --exit-code "$rc" --first 2 --last $(( STEPS - 1 )) --trainer-gpus "$trainer_gpus" --gpus "$used" \
    --tag "${SIZES_TAG:-}" --args "${args[*]} ${extra[*]} gpu=$gpu${SIZES_CAP_GIB:+ capped=${SIZES_CAP_GIB}GiB}${PYTORCH_CUDA_ALLOC_CONF:+ alloc=$PYTORCH_CUDA_ALLOC_CONF} \
wall_s=$(( $(date +%s) - start ))" >> "$OUT/sizes.jsonl"
  tail -n 1 "$OUT/sizes.jsonl"
done
