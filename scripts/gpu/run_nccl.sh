#!/bin/bash
# The NCCL transport on two GPUs (kind nvidia-h200-x2): trainer on GPU 0, generator on GPU 1.
# After the stash call of docs/gpu.md, on the same warm machine:
#   run(kind="nvidia-h200-x2", carry=[".gpu/b"],
#       command="set -o pipefail; source .gpu/b/install.sh && bash scripts/gpu/run_nccl.sh 2>&1 | tee $OUT/nccl.log")
# Runs scripts/bench_nccl_sync.py under torchrun (NCCL_FLAVORS, default "0.6B 1.7B"; NCCL_ARGS for more flags):
# correctness on this layout, ours vs a raw broadcast of the same bytes vs vLLM's NCCL engine.
# Writes $OUT/nccl_sync.json, $OUT/nccl_topo.txt and $OUT/benchmarks.md (merge with scripts/gpu/merge_sections.py).
source "$(dirname "$0")/multi_gpu_env.sh"  # cd to the repo, $OUT, NVLink multicast off
# NCCL's setup lines say which transport the two GPUs use (P2P/NVLink, SHM, ...).
export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m > "$OUT/nccl_topo.txt" 2>&1; cat "$OUT/nccl_topo.txt"
python3 -c 'import torch; print("devices", torch.cuda.device_count(), "p2p 0->1", torch.cuda.can_device_access_peer(0, 1))'
# The sync's NaN/inf scan is an inf-norm: it must propagate NaN on this GPU (it does on CPU).
python3 -c 'import torch
for dt in (torch.float32, torch.bfloat16):
    t = torch.randn(1 << 20, device="cuda").to(dt); t[12345] = float("nan"); u = t.clone(); u[7] = float("-inf")
    n = torch._foreach_norm([t, u, t[:4096].clone()], ord=float("inf"))
    assert n[0].isnan() and n[1].isnan() | n[1].isinf() and n[2].isfinite(), (dt, n)
print("inf-norm NaN/inf check: ok")' || exit 1
start=$(date +%s)
timeout ${NCCL_TIMEOUT_S:-330} python3 -m torchtitan_rl.launch --nproc-per-node 2 --master-port 29555 \
  scripts/bench_nccl_sync.py --flavors ${NCCL_FLAVORS:-0.6B 1.7B} --json "$OUT/nccl_sync.json" ${NCCL_ARGS:-} \
  > "$OUT/nccl_full.log" 2>&1
rc=$?
echo "=== bench_nccl_sync: exit $rc after $(( $(date +%s) - start )) s"
grep -v "NCCL INFO" "$OUT/nccl_full.log" | tail -n 400
echo "=== NCCL transports:"; grep -E "via (P2P|SHM|NET|CUMEM)|Connected all|NCCL version" "$OUT/nccl_full.log" | sort | uniq -c | sort -rn | head -20
[ -f docs/benchmarks.md ] && cp docs/benchmarks.md "$OUT/benchmarks.md"
exit $rc
