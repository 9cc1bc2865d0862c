#!/bin/bash
# The "Mixture of experts" rows (issue 40), every row as written, in one command; raw metrics under $OUT/moe/ and
# scripts/gpu/results/moe/, the table into docs/benchmarks.md by scripts/gpu/moe_table.py. Needs chunk C
# (vLLM's _moe_C, .gpu/c/stash_c.sh) beside A and B. MOE_ROWS picks rows (default: all):
#   small     debugmodel_moe (torchtitan's, 64 experts top 8) through the GRPO loop on one GPU, colocated, CUDA graphs
#   small_r3  the same with grpo.routing_replay true
#   a3b_1gpu  Qwen3-30B-A3B shape, random weights, one GPU: trainer bf16 masters + CPU offload, engine asleep
#             (generator.sleep weights) while the trainer steps; what refuses it is recorded
#   a3b_4gpu  the same shape on four GPUs: FSDP over 4 trainer ranks, colocated engine asleep while it steps
# Each row: MOE_STEPS steps (default 10); metrics.jsonl has sync_s, train_s, step_s, routing_mismatch.
set -uo pipefail
OUT=${OUT:-/tmp/out}
RES=$OUT/moe
mkdir -p "$RES"
STEPS=${MOE_STEPS:-10}
ROWS=${MOE_ROWS:-"small small_r3 a3b_1gpu a3b_4gpu"}
GPUS=$(nvidia-smi -L | wc -l)
COMMON=(--job.device cuda --grpo.task digits --model.max_seq_len 256 --generator.max_model_len 256
        --generator.sampling.max_tokens 64 --trainer.steps "$STEPS" --trainer.checkpoint.enable false
        --metrics.enable true)
row() {  # name, world size, args...
  local name=$1 world=$2; shift 2
  if [ "$world" -gt "$GPUS" ]; then echo "$name: needs $world GPUs, this machine has $GPUS" > "$RES/$name.refused"; return; fi
  local start=$(date +%s)
  if [ "$world" -eq 1 ]; then
    timeout 900 python -m torchtitan_rl.simple_grpo "${COMMON[@]}" --job.output_dir "$RES/$name" "$@" > "$RES/$name.log" 2>&1
  else
    timeout 900 python -m torchtitan_rl.launch --nproc-per-node "$world" -m torchtitan_rl.simple_grpo "${COMMON[@]}" \
      --job.output_dir "$RES/$name" "$@" > "$RES/$name.log" 2>&1
  fi
  local rc=$?
  echo "$name rc=$rc wall=$(( $(date +%s) - start ))s" | tee -a "$RES/rows.txt"
  [ $rc -ne 0 ] && tail -3 "$RES/$name.log" | tee "$RES/$name.refused"
}
for r in $ROWS; do
  case $r in
    small)    row small 1 --model.flavor debugmodel_moe --grpo.prompts_per_step 16 --grpo.group_size 8 ;;
    small_r3) row small_r3 1 --model.flavor debugmodel_moe --grpo.prompts_per_step 16 --grpo.group_size 8 \
                --grpo.routing_replay true ;;
    a3b_1gpu) row a3b_1gpu 1 --model.flavor 30B-A3B --grpo.prompts_per_step 8 --grpo.group_size 8 \
                --trainer.master_dtype bfloat16 --trainer.cpu_offload true --generator.sleep weights \
                --generator.gpu_memory_utilization 0.85 --trainer.activation_checkpoint full ;;
    a3b_4gpu) row a3b_4gpu 4 --model.flavor 30B-A3B --grpo.prompts_per_step 8 --grpo.group_size 8 \
                --generator.sleep weights --generator.gpu_memory_utilization 0.85 \
                --trainer.activation_checkpoint full ;;
  esac
done
mkdir -p scripts/gpu/results/moe
cp -r "$RES"/. scripts/gpu/results/moe/ 2>/dev/null
python scripts/gpu/moe_table.py "$RES" --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
  --write docs/benchmarks.md
