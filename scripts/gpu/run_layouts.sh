#!/bin/bash
# The multi-GPU layout tables (docs/benchmarks.md "Layouts on two GPUs", "Layouts on four GPUs"):
# run_configs/qwen3_0.6b.toml (random weights, 64 prompts x 8 x 256 tokens) for LAYOUT_STEPS steps (default 14),
# medians over steps WINDOW (default "3 13"). LAYOUTS names the runs, in order:
#   single     colocated in one process on one GPU (what a run without torchrun does)
#   everyN     colocated under torchrun on N GPUs, every rank's engine generates its block (the default)
#   ncclTxR    T FSDP trainer ranks + R generator replicas, each on its own GPU, synchronous (transport nccl)
#   asyncTxR   the same with grpo.max_staleness 1 and truncated importance weights
#   profile    scripts/gpu/profile_generate.py on one GPU (what bounds one generate)
# Layouts joined by '+' run at the same time on disjoint GPUs (GPUs are handed out in order from 0), e.g.
# LAYOUTS="single+every2 every4 nccl2x2": 'single' on GPU 0 while 'every2' runs on GPUs 1-2, then every4 alone.
# LAYOUT_ARGS adds overrides to every run (e.g. "--model.flavor 1.7B"); LAYOUT_CONFIG another config.
# After the stash call of docs/gpu.md, on the same warm machine (each call under 10 minutes):
#   run(kind="nvidia-h100-x4", carry=[".gpu/b"], command="source .gpu/b/install.sh && \
#       LAYOUTS='single+every2 every4' bash scripts/gpu/run_layouts.sh")
# Writes $OUT/layout_<name>.jsonl (the run's metrics), $OUT/layouts.jsonl (one summary line per run, from
# scripts/gpu/summarize_run.py) and samples every GPU's used memory with nvidia-smi every 0.5 s for the peaks.
source "$(dirname "$0")/multi_gpu_env.sh"
STEPS=${LAYOUT_STEPS:-14}
WINDOW=${WINDOW:-3 13}
work=$(mktemp -d /tmp/layouts.XXXXXX)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
port=29557

# launch NAME FIRST_GPU: starts one layout in the background on GPUs FIRST_GPU.., sets $ngpus and $pid.
launch() {
  local name=$1 first=$2 args=() engines=1 trainers replicas
  case $name in
    single)  ngpus=1 ;;
    profile) ngpus=1 ;;
    every*)  ngpus=${name#every}; engines=$ngpus ;;
    nccl*x*|async*x*)
      local spec=${name#nccl}; spec=${spec#async}
      trainers=${spec%x*}; replicas=${spec#*x}; ngpus=$((trainers + replicas)); engines=$replicas
      args=(--weight_sync.transport nccl --generator.gpu_memory_utilization 0.8
            --generator.parallelism.data_parallel_replicate_degree "$replicas")
      [[ $name == async* ]] && args+=(--grpo.max_staleness 1 --grpo.importance_correction truncate)
      # 64 x 8 rows do not split over 3 trainer ranks: 63 prompts (504 rows) for them
      [ $((64 * 8 % trainers)) = 0 ] || args+=(--grpo.prompts_per_step $((64 * 8 / trainers / 8 * trainers))) ;;
    *) echo "unknown layout $name"; return 2 ;;
  esac
  local gpus; gpus=$(seq -s, "$first" $((first + ngpus - 1)))
  echo "$gpus" > "$work/$name.gpus"; echo "$engines" > "$work/$name.engines"
  date +%s > "$work/$name.start"
  if [ "$name" = profile ]; then
    CUDA_VISIBLE_DEVICES=$gpus timeout "${LAYOUT_TIMEOUT_S:-300}" python3 scripts/gpu/profile_generate.py \
      --json "$OUT/profile_generate.json" > "$work/$name.log" 2>&1 &
  elif [ "$ngpus" = 1 ]; then
    CUDA_VISIBLE_DEVICES=$gpus timeout "${LAYOUT_TIMEOUT_S:-300}" python3 -m torchtitan_rl.simple_grpo \
      --config "${LAYOUT_CONFIG:-run_configs/qwen3_0.6b.toml}" --trainer.steps "$STEPS" --job.output_dir "$work/$name" \
      --trainer.checkpoint.enable false ${LAYOUT_ARGS:-} > "$work/$name.log" 2>&1 &
  else
    port=$((port + 1))
    CUDA_VISIBLE_DEVICES=$gpus timeout "${LAYOUT_TIMEOUT_S:-300}" python3 -m torchtitan_rl.launch \
      --nproc-per-node "$ngpus" --master-port "$port" -m torchtitan_rl.simple_grpo \
      --config "${LAYOUT_CONFIG:-run_configs/qwen3_0.6b.toml}" --trainer.steps "$STEPS" --job.output_dir "$work/$name" \
      --trainer.checkpoint.enable false --weight_sync.peer_timeout_s 200 "${args[@]}" ${LAYOUT_ARGS:-} \
      > "$work/$name.log" 2>&1 &
  fi
  pid=$!
}

report() {  # NAME RC
  local name=$1 rc=$2
  echo "=== $name: exit $rc after $(( $(date +%s) - $(cat "$work/$name.start") )) s on GPUs $(cat "$work/$name.gpus")"
  tr '\r' '\n' < "$work/$name.log" | grep -v "^\s*$" | grep -iE "error|torchtitan_rl:|Traceback" | tail -n 8
  [ "$rc" = 0 ] || tr '\r' '\n' < "$work/$name.log" | tail -n 120 > "$OUT/layout_${name}_failed.log"
  [ "$name" = profile ] && { tail -n 30 "$work/$name.log"; return; }
  cp "$work/$name/latest/metrics.jsonl" "$OUT/layout_$name.jsonl" 2>/dev/null
  python3 scripts/gpu/summarize_run.py "$work/$name" --name "$name" --gpus "$(cat "$work/$name.gpus")" \
    --mem "$work/mem_$group_no.csv" --rc "$rc" --engines "$(cat "$work/$name.engines")" --window $WINDOW \
    --extra "args=${LAYOUT_ARGS:-}" "steps=$STEPS" "gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)" \
    | tee -a "$OUT/layouts.jsonl"
}

group_no=0
for group in ${LAYOUTS:-single every2 nccl1x1 async1x1}; do
  first=0; names=(); pids=(); group_no=$((group_no + 1))
  # One sampler per group: a peak belongs to the runs of this group only.
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$work/mem_$group_no.csv" &
  smi=$!
  for name in ${group//+/ }; do
    launch "$name" "$first" || exit 2
    names+=("$name"); pids+=("$pid"); first=$((first + ngpus))
  done
  for i in "${!names[@]}"; do
    wait "${pids[$i]}"; report "${names[$i]}" $?
  done
  kill $smi 2>/dev/null
done
