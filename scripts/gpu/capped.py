"""Run a module as if this process's GPU had --gib GiB: an 80 GB H100's budget on a bigger card (an H200).

    python scripts/gpu/capped.py --gib 79.2 -m torchtitan_rl.simple_grpo --config run_configs/qwen3_0.6b.toml ...
    python scripts/gpu/capped.py --gib 79.2 --check     # allocates until out of memory: prints where the cap held

The card's memory beyond the cap is taken at the start by one allocation outside torch's allocator (the driver's
cuMemAlloc, held to the process's end), so every allocator in the process runs out where an 80 GB card would: torch's,
vLLM's sleep-mode pool (cuMemCreate), CUDA graphs, NCCL. A per-process fraction of torch's allocator would not do:
vLLM's sleep-mode pool allocates through torch's allocator and keeps its blocks there while it unmaps them asleep, so
the fraction would count a sleeping engine. The memory queries that size a run report the cap as the card's total:
torch.cuda.mem_get_info (the run's memory estimate, job.fit) and torch.accelerator.get_memory_info (vLLM's
gpu_memory_utilization). Under torchrun (python -m torchtitan_rl.launch ... scripts/gpu/capped.py --gib ...) each rank
caps its own GPU (LOCAL_RANK).
"""

import ctypes
import os
import re
import runpy
import sys

import torch

GIB = 1 << 30
HELD = re.compile(r"^\[capped\] GPU \d+: [\d.]+ GiB, held (\d+) MiB beyond the cap")
"""The line ``said`` prints, as sizes_row.py reads it (nvidia-smi counts the held memory as used)."""


def said(local: int, total: int, held: int, cap: int) -> str:
    """What a capped process prints at its start: its GPU, the memory held beyond the cap, the cap."""
    return (f"[capped] GPU {local}: {total / GIB:.1f} GiB, held {held >> 20} MiB beyond the cap: "
            f"{min(total, cap) / GIB:.1f} GiB left to the run")


def hold_beyond(cap: int, device: int) -> tuple[int, int]:
    """Allocate the card's memory beyond ``cap`` bytes outside torch's allocator: (the card's bytes, those held)."""
    torch.cuda.set_device(device)
    torch.zeros(1, device=device)  # the runtime's primary context, current on this thread, where cuMemAlloc allocates
    total = torch.cuda.mem_get_info(device)[1]
    extra = total - cap
    if extra <= 0:
        return total, 0
    pointer = ctypes.c_uint64()
    status = ctypes.CDLL("libcuda.so.1").cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(extra))
    if status != 0:
        raise SystemExit(f"capped.py: GPU {device}: cuMemAlloc of the {extra / GIB:.1f} GiB beyond the cap failed "
                         f"(CUresult {status}): is another process on it?")
    return total, extra


def report_cap(cap: int) -> None:
    """The memory queries, then torch allocations of 256 MiB until the card refuses: what a run can take."""
    device = torch.cuda.current_device()
    print(f"[capped] mem_get_info {[round(b / GIB, 2) for b in torch.cuda.mem_get_info(device)]} GiB, "
          f"accelerator.get_memory_info {[round(b / GIB, 2) for b in torch.accelerator.get_memory_info(device)]}",
          flush=True)
    chunks = []
    try:
        while True:
            chunks.append(torch.empty(256 << 20, dtype=torch.uint8, device=device))
    except torch.OutOfMemoryError:
        pass
    taken = len(chunks) * (256 << 20)
    print(f"[capped] torch took {taken / GIB:.2f} GiB before out of memory (cap {cap / GIB:.1f} GiB)", flush=True)


def main() -> None:
    args = sys.argv[1:]
    check = args[2:3] == ["--check"]
    if len(args) < 3 or args[0] != "--gib" or not (check or (len(args) >= 4 and args[2] == "-m")):
        raise SystemExit("usage: capped.py --gib GIB (-m MODULE [ARGS...] | --check)")
    if not torch.cuda.is_available():
        raise SystemExit("capped.py: no CUDA device (it caps a GPU's memory)")
    cap = int(float(args[1]) * GIB)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    real_cuda, real_accelerator = torch.cuda.mem_get_info, torch.accelerator.get_memory_info
    total, held = hold_beyond(cap, local)

    def mem_get_info(device=None):
        free, total = real_cuda(device)
        return free, min(total, cap)

    def get_memory_info(device=None):
        free, total = real_accelerator(device)
        return free, min(total, cap)

    torch.cuda.mem_get_info = torch.cuda.memory.mem_get_info = mem_get_info
    torch.accelerator.get_memory_info = get_memory_info
    print(said(local, total, held, cap), flush=True)
    if check:
        report_cap(cap)
        return
    sys.argv = [args[3], *args[4:]]
    runpy.run_module(args[3], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
