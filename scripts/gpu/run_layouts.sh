#!/bin/bash
# The multi-GPU layout table (docs/benchmarks.md "Layouts on two GPUs"): run_configs/qwen3_0.6b.toml (random
# weights, 64 prompts x 8 x 256 tokens) for LAYOUT_STEPS steps (default 14) per layout, back to back on one
# machine of NPROC GPUs (default 2). LAYOUTS picks from:
#   single      colocated in one process on GPU 0 (what a run without torchrun does; the other GPU idles),
#               with scripts/gpu/profile_generate.py on GPU 1 meanwhile (PROFILE=0 skips it)
#   rank0       colocated under torchrun, rank 0's engine generates the whole batch (colocated_ranks first)
#   every       colocated, every trainer rank's engine generates its block (colocated_ranks all)
#   nccl        NPROC-1 trainer ranks + 1 generator rank, synchronous (transport nccl)
#   nccl_async  the same with grpo.max_staleness 1 and truncated importance weights
# After the stash call of docs/gpu.md, on the same warm machine (each call under 10 minutes: two layouts a call):
#   run(kind="nvidia-h100-x2", carry=[".gpu/b"], command="source .gpu/b/install.sh && LAYOUTS='rank0 every' bash scripts/gpu/run_layouts.sh")
# Writes $OUT/layout_<name>.jsonl (metrics), $OUT/layouts.json (one summary line per layout, appended) and
# samples every GPU's used memory with nvidia-smi every 0.5 s for the peak.
source "$(dirname "$0")/multi_gpu_env.sh"
NPROC=${NPROC:-2}
STEPS=${LAYOUT_STEPS:-14}
work=$(mktemp -d /tmp/layouts.XXXXXX)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
for layout in ${LAYOUTS:-rank0 every nccl nccl_async}; do
  launch=(python3 -m torch.distributed.run --nproc-per-node "$NPROC" --master-port 29557)
  case $layout in
    single) args=(); launch=(env CUDA_VISIBLE_DEVICES=0 python3)
            if [ "${PROFILE:-1}" = 1 ]; then
              CUDA_VISIBLE_DEVICES=1 python3 scripts/gpu/profile_generate.py --json "$OUT/profile_generate.json" \
                > "$OUT/profile_generate.log" 2>&1 &
            fi ;;
    rank0) args=(--generator.colocated_ranks first) ;;
    every) args=(--generator.colocated_ranks all) ;;
    nccl) args=(--weight_sync.transport nccl --generator.gpu_memory_utilization 0.8) ;;
    nccl_async) args=(--weight_sync.transport nccl --generator.gpu_memory_utilization 0.8
                      --grpo.max_staleness 1 --grpo.importance_correction truncate) ;;
    *) echo "unknown layout $layout"; exit 2 ;;
  esac
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$work/$layout.mem" &
  smi=$!
  start=$(date +%s)
  timeout ${LAYOUT_TIMEOUT_S:-270} "${launch[@]}" -m torchtitan_rl.simple_grpo --config run_configs/qwen3_0.6b.toml --trainer.steps "$STEPS" \
    --job.output_dir "$work/$layout" --trainer.checkpoint.enable false --weight_sync.peer_timeout_s 200 \
    "${args[@]}" > "$work/$layout.log" 2>&1
  rc=$?
  kill $smi
  echo "=== $layout: exit $rc after $(( $(date +%s) - start )) s"
  tr '\r' '\n' < "$work/$layout.log" | grep -v "^\s*$" | grep -iE "error|torchtitan_rl:" | tail -n 8
  [ $rc = 0 ] || tr '\r' '\n' < "$work/$layout.log" | tail -n 150 > "$OUT/layout_${layout}_failed.log"
  cp "$work/$layout/metrics.jsonl" "$OUT/layout_$layout.jsonl" 2>/dev/null
  python3 - "$work/$layout/metrics.jsonl" "$work/$layout.mem" "$layout" "$rc" "$NPROC" "${args[*]}" >> "$OUT/layouts.json" <<'PY'
import json, statistics, sys
from pathlib import Path

metrics, mem, layout, rc, nproc, args = sys.argv[1:]
records = [json.loads(l) for l in Path(metrics).read_text().splitlines()] if Path(metrics).exists() else []
records = [r for r in records if "step_s" in r]
kept = [r for r in records if 3 <= r["step"] <= 13] or records  # the issue's window: steps 3-13
keys = ("step_s", "generate_s", "train_s", "sync_s", "wait_rollouts_s", "generator_idle_s", "gen_tokens_per_s")
peak = {}
for line in Path(mem).read_text().splitlines():
    try:
        gpu, used = (int(x) for x in line.split(","))
    except ValueError:
        continue
    peak[gpu] = max(peak.get(gpu, 0), used)
print(json.dumps({
    "layout": layout, "exit_code": int(rc), "nproc": int(nproc), "args": args, "steps_logged": len(records),
    "median_steps_3_13": {k: statistics.median(r[k] for r in kept) for k in keys} if kept else {},
    "tokens_per_step": statistics.median(r["gen_tokens_per_s"] * r["generate_s"] for r in kept) if kept else None,
    "peak_gpu_mem_mib": peak, "reward_first_last": [records[0]["reward_mean"], records[-1]["reward_mean"]] if records else None,
}))
PY
  tail -n 1 "$OUT/layouts.json"
done
wait  # the profile, if it still runs
