"""run/memory_watch.py's phase peaks, read on CPU from this process's resident memory: a transient allocation is
its phase's peak and no other's."""

import time

import psutil
import torch

from torchtitan_rl.run.memory_watch import GIB, PhasePeaks


def test_a_phase_keeps_its_largest_reading_and_a_take_starts_the_next_step_afresh():
    peaks = PhasePeaks(torch.device("cpu"), interval_s=0.02)
    try:
        peaks.start("before")
        time.sleep(0.1)
        peaks.start("held")
        held = torch.ones(512 << 20, dtype=torch.uint8)  # 0.5 GiB, every page written
        time.sleep(0.2)  # ten readings
        del held
        peaks.start("after")
        time.sleep(0.1)
        step = peaks.take()
        assert set(step) == {"mem_before_gib", "mem_held_gib", "mem_after_gib"}
        assert step["mem_held_gib"] > step["mem_before_gib"] + 0.45, step
        assert step["mem_after_gib"] < step["mem_held_gib"] - 0.45, step  # freed before the phase began
        time.sleep(0.1)
        assert peaks.take() == {}  # between take() and the next start() nothing is measured
        peaks.start("next")
        assert set(peaks.take()) == {"mem_next_gib"}
        assert 0 < step["mem_before_gib"] < psutil.virtual_memory().total / GIB
    finally:
        peaks.close()
