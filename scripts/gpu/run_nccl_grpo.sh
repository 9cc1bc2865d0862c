#!/bin/bash
# The GRPO loop with the generator on its own GPU (weight_sync.transport nccl): NPROC processes under
# torchrun, ranks 0..NPROC-2 train (FSDP), the last rank holds the generator (vLLM) on the last GPU.
# NPROC=2 (default) on kind nvidia-h200-x2; NPROC=3 on nvidia-h200-x4 (NPROC-1 must divide
# prompts_per_step * group_size = 512). REPLICAS=R (default 1): the last R ranks are generator replicas,
# each on its own GPU, fed by one broadcast (NPROC=4 REPLICAS=2 on nvidia-h200-x4: 2 trainer GPUs + 2). After the stash call of docs/gpu.md, on the same warm machine:
#   run(kind="nvidia-h200-x2", carry=[".gpu/b"],
#       command="set -o pipefail; source .gpu/b/install.sh && bash scripts/gpu/run_nccl_grpo.sh 2>&1 | tee $OUT/nccl_grpo.log | tail -c 11000")
# Runs GRPO_STEPS (default 10) steps of python -m torchtitan_rl.simple_grpo on run_configs/qwen3_0.6b.toml
# (GEN_MEM: the generator's gpu_memory_utilization on its own GPU, default 0.8; GRPO_ARGS: more
# --section.field overrides). Writes $OUT/nccl_grpo_metrics.jsonl, $OUT/nccl_grpo_summary.json and
# $OUT/nccl_grpo_full.log.
source "$(dirname "$0")/multi_gpu_env.sh"  # cd to the repo, $OUT, NVLink multicast off
NPROC=${NPROC:-2}
REPLICAS=${REPLICAS:-1}
STEPS=${GRPO_STEPS:-10}
work=$(mktemp -d /tmp/nccl_grpo.XXXXXX)
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
start=$(date +%s)
# peer_timeout_s 300: a rank that waits that long for the other side (engine start included) gives up
# with an error well inside the call's limit instead of hanging until it.
timeout ${NCCL_GRPO_TIMEOUT_S:-540} python3 -m torchtitan_rl.launch --nproc-per-node "$NPROC" --master-port 29556 \
  -m torchtitan_rl.simple_grpo --config run_configs/qwen3_0.6b.toml --weight_sync.transport nccl \
  --trainer.steps "$STEPS" --job.output_dir "$work" --trainer.checkpoint.enable false \
  --generator.gpu_memory_utilization "${GEN_MEM:-0.8}" --weight_sync.peer_timeout_s 300 \
  --generator.parallelism.data_parallel_replicate_degree "$REPLICAS" ${GRPO_ARGS:-} \
  > "$OUT/nccl_grpo_full.log" 2>&1
rc=$?
echo "=== simple_grpo, transport nccl, $NPROC processes ($REPLICAS generator replicas): exit $rc after $(( $(date +%s) - start )) s"
tr '\r' '\n' < "$OUT/nccl_grpo_full.log" | grep -v "^\s*$" | tail -n 60
[ -f "$work/latest/metrics.jsonl" ] && cp "$work/latest/metrics.jsonl" "$OUT/nccl_grpo_metrics.jsonl"
python3 - "$work/latest/metrics.jsonl" "$OUT/nccl_grpo_summary.json" "$NPROC" "$STEPS" "$rc" "$REPLICAS" <<'EOF'
import json, statistics, sys
from pathlib import Path

metrics, summary_path, nproc, steps, rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
replicas = int(sys.argv[6])
records = [json.loads(line) for line in Path(metrics).read_text().splitlines()] if Path(metrics).exists() else []
records = [r for r in records if "step_s" in r]  # training steps; held-out evaluations are lines of their own
kept = records[2:] or records  # steps 0-1 include warm-ups
keys = ("step_s", "sync_s", "generate_s", "train_s", "gen_tokens_per_s", "mismatch_max", "mismatch_mean")
summary = {
    "exit_code": rc, "nproc": nproc, "trainer_ranks": nproc - replicas, "replicas": replicas, "steps_asked": steps, "steps_logged": len(records),
    "weight_version_is_step": all(r["weight_version"] == r["step"] for r in records),
    "first_step_s": records[0]["step_s"] if records else None,
    "median_from_step_2": {k: statistics.median(r[k] for r in kept) for k in keys} if kept else {},
    "max_mismatch_max": max((r["mismatch_max"] for r in records), default=None),
    "reward_first_last": [records[0]["reward_mean"], records[-1]["reward_mean"]] if records else None,
}
Path(summary_path).write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
EOF
exit $rc
