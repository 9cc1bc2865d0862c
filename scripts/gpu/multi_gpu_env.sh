# Sourced by the multi-GPU scripts (run_nccl.sh, run_nccl_grpo.sh): the repository root as the
# working folder, $OUT, and the environment every multi-GPU run on the lent machines needs.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
# NVLink multicast stays off (KINDS.md): it can take the host's shared GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
