"""run/memory_watch.py's phase peaks, read on CPU from a process's resident memory: a transient allocation is its
phase's peak and no other's.

The phases run in a fresh process: in a test worker that freed a large heap before, the allocator can hand out pages
that are still resident, and an allocation then leaves the resident size where it was (CI saw 4.26 GiB in every
phase)."""

import json
import subprocess
import sys

import psutil

from tests.helpers import REPO
from torchtitan_rl.run.memory_watch import GIB, device_readings

PHASES = """
import json, time
import torch
from torchtitan_rl.run.memory_watch import PhasePeaks

peaks = PhasePeaks(torch.device("cpu"), interval_s=0.02)
peaks.start("before")
time.sleep(0.1)
peaks.start("held")
held = torch.ones(512 << 20, dtype=torch.uint8)  # 0.5 GiB, every page written
time.sleep(0.2)  # ten readings
del held
peaks.start("after")
time.sleep(0.1)
step = peaks.take()
time.sleep(0.1)
between = peaks.take()  # between take() and the next start() nothing is measured
peaks.start("next")
print(json.dumps({"step": step, "between": between, "next": peaks.take()}))
peaks.close()
"""


def test_a_phase_keeps_its_largest_reading_and_a_take_starts_the_next_step_afresh():
    proc = subprocess.run([sys.executable, "-c", PHASES], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    step = got["step"]
    assert set(step) == {"mem_before_gib", "mem_held_gib", "mem_after_gib"}
    assert step["mem_held_gib"] > step["mem_before_gib"] + 0.45, step
    assert step["mem_after_gib"] < step["mem_held_gib"] - 0.45, step  # freed before the phase began
    assert got["between"] == {}
    assert set(got["next"]) == {"mem_next_gib"}
    assert 0 < step["mem_before_gib"] < psutil.virtual_memory().total / GIB
    # a GPU's line splits each reading into parts; the device's readings leave them out
    assert device_readings({**step, "mem_held_tensors_gib": 0.5, "mem_held_cached_gib": 0.1, "step": 3}) == {
        "before": step["mem_before_gib"], "held": step["mem_held_gib"], "after": step["mem_after_gib"]}
