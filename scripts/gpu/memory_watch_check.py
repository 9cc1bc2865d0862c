"""run/memory_watch.py on a GPU: what each phase's reading and its parts say about allocations we know.

A phase that holds a 2 GiB tensor reads 2 GiB above an idle one, all of it ``tensors``; a phase that frees a 1 GiB
tensor and then asks for 1.5 GiB (a block the freed one cannot hold) reads both, 1.5 GiB of ``tensors`` and 1 GiB
``cached``. Torch alone, no vLLM (a device call without the stash: PYTHONPATH=. python3
scripts/gpu/memory_watch_check.py). Prints one JSON line; exit 1 when a reading is off by more than 0.1 GiB.
"""

import json
import sys
import time

import torch

from torchtitan_rl.run.memory_watch import GIB, PhasePeaks

TOLERANCE = 0.1
"""GiB: the allocator rounds blocks up to 2 MiB and CUDA's used bytes move with other processes' contexts."""


def main() -> int:
    device = torch.device("cuda", 0)
    torch.empty(1, device=device)  # the CUDA context first: it is no phase's
    peaks = PhasePeaks(device, interval_s=0.01)
    peaks.start("idle")
    time.sleep(0.1)
    peaks.start("held")
    held = torch.empty(2 * GIB, dtype=torch.uint8, device=device)
    time.sleep(0.1)
    del held
    torch.cuda.empty_cache()
    peaks.start("cached")
    freed = torch.empty(GIB, dtype=torch.uint8, device=device)
    del freed
    larger = torch.empty(3 * GIB // 2, dtype=torch.uint8, device=device)
    time.sleep(0.1)
    got = peaks.take()  # before the del: a reading after it would see 2.5 GiB cached at the same used bytes
    peaks.close()
    del larger
    want = {"mem_held_tensors_gib": 2.0, "mem_held_cached_gib": 0.0, "mem_cached_tensors_gib": 1.5,
            "mem_cached_cached_gib": 1.0, "held_over_idle": 2.0, "cached_over_idle": 2.5}
    got["held_over_idle"] = got["mem_held_gib"] - got["mem_idle_gib"]
    got["cached_over_idle"] = got["mem_cached_gib"] - got["mem_idle_gib"]
    off = {k: round(got[k], 3) for k, v in want.items() if abs(got[k] - v) > TOLERANCE}
    print(json.dumps({"got": {k: round(v, 3) for k, v in got.items()}, "off": off,
                      "gpu": torch.cuda.get_device_name(device)}))
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
