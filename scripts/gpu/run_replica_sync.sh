#!/bin/bash
# The sync to R generator replicas on one host (docs/scaling.md, docs/benchmarks.md "Weight sync to R generator
# replicas"): scripts/bench_replica_sync.py under torchrun with 1 + R processes, one GPU each, for R in REPLICAS
# (default "1 2 3") and model shapes FLAVORS (default "0.6B 1.7B 4B"). Needs R + 1 GPUs.
# After the stash call of docs/gpu.md, on the same warm machine:
#   run(kind="nvidia-h100-x4", carry=[".gpu/b"], command="source .gpu/b/install.sh && bash scripts/gpu/run_replica_sync.sh")
# Writes $OUT/replicas.json (one row per shape and R), $OUT/replicas_R<R>.log and $OUT/benchmarks.md (the device
# copy of docs/benchmarks.md with the new section: merge it with scripts/gpu/merge_sections.py).
source "$(dirname "$0")/multi_gpu_env.sh"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
rc_all=0
for R in ${REPLICAS:-1 2 3}; do
  start=$(date +%s)
  timeout "${REPLICA_TIMEOUT_S:-240}" python3 -m torchtitan_rl.launch --nproc-per-node $((R + 1)) --master-port $((29600 + R)) \
    scripts/bench_replica_sync.py --flavors ${FLAVORS:-0.6B 1.7B 4B} --repeats "${REPEATS:-5}" \
    --json "$OUT/replicas.json" > "$OUT/replicas_R$R.log" 2>&1
  rc=$?
  echo "=== R=$R: exit $rc after $(( $(date +%s) - start )) s"
  grep -E '^\{"flavor"' "$OUT/replicas_R$R.log"
  [ $rc = 0 ] || { rc_all=$rc; tail -n 40 "$OUT/replicas_R$R.log"; }
done
cp docs/benchmarks.md "$OUT/benchmarks.md"
exit $rc_all
