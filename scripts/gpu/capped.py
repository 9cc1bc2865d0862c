"""Run a module as if this process's GPU had --gib GiB: an 80 GB H100's budget on a bigger card (an H200).

    python scripts/gpu/capped.py --gib 79.2 -m torchtitan_rl.simple_grpo --config run_configs/qwen3_0.6b.toml ...

torch's caching allocator is capped at that share of the card (torch.cuda.set_per_process_memory_fraction), and
torch.cuda.mem_get_info reports it as the card's total (free: the cap less what is used), so vLLM sizes
generator.gpu_memory_utilization against it and the run's memory estimate and job.fit check against it. vLLM's
sleep-mode pool (cuMemCreate, outside torch's allocator) is not capped, but it stays inside the utilization's
share. Under torchrun (python -m torchtitan_rl.launch ... scripts/gpu/capped.py --gib ...) each rank caps its own
GPU (LOCAL_RANK).
"""

import os
import runpy
import sys

import torch


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 4 or args[0] != "--gib" or args[2] != "-m":
        raise SystemExit("usage: capped.py --gib GIB -m MODULE [ARGS...]")
    cap, module = int(float(args[1]) * (1 << 30)), args[3]
    real = torch.cuda.mem_get_info

    def mem_get_info(device=None):
        free, total = real(device)
        if total <= cap:
            return free, total
        return max(0, cap - (total - free)), cap

    torch.cuda.mem_get_info = mem_get_info
    local = int(os.environ.get("LOCAL_RANK", "0"))
    total = real(local)[1]
    if total > cap:
        torch.cuda.set_per_process_memory_fraction(cap / total, local)
    print(f"[capped] GPU {local}: {total / (1 << 30):.1f} GiB capped at {cap / (1 << 30):.1f}", flush=True)
    sys.argv = [module, *args[4:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
