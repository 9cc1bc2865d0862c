"""The memory a step's phases held, measured from outside the allocators, beside the estimate (run/memory.py).

A daemon thread reads, every ``interval_s``, what this rank's device holds: on a GPU its total less its free bytes
as CUDA counts them (what nvidia-smi shows as used: every process and allocator on it, vLLM's sleep-mode pool and the
CUDA contexts included, which torch's own counters leave out or, after a sleep, overstate), on CPU this process's
resident memory. It keeps the largest reading of each phase; a peak shorter than the interval can be missed. The
loop starts it after the engine has captured its CUDA graphs: no reading runs beside a capture.

On a GPU two readings from torch's caching allocator split a phase's peak, for the estimate's terms to be checked
one by one: ``tensors``, the most the process's tensors held during the phase beyond what they held as it began
(exact: torch's own peak counter, reset at each phase; vLLM's sleeping memory is in both and cancels), and
``cached``, what the allocator kept reserved but unused at the phase's peak reading (blocks freed tensors left that
the next ones could not reuse). The rest of a reading is the tensors held from before and what lies outside torch
(CUDA contexts, cuBLAS's and NCCL's workspaces, CUDA graphs' own memory).
"""

import threading

import psutil
import torch

GIB = 1 << 30
PARTS = ("tensors", "cached")
"""What a GPU phase's reading splits into, logged as ``mem_<phase>_<part>_gib`` beside ``mem_<phase>_gib``."""


def device_readings(record: dict) -> dict[str, float]:
    """Phase -> what the device held at its peak, from a metrics.jsonl line (its parts left out)."""
    return {k[4:-4]: v for k, v in record.items() if k.startswith("mem_") and k.endswith("_gib")
            and not k.endswith(tuple(f"_{part}_gib" for part in PARTS))}


class PhasePeaks:
    """``start(phase)`` names the phase the readings from now on belong to; ``take()`` ends the step's
    measurement and returns ``{"mem_<phase>_gib": the phase's largest reading}``, on a GPU with
    ``mem_<phase>_tensors_gib`` and ``mem_<phase>_cached_gib`` (above). ``close()`` stops the thread."""

    def __init__(self, device: torch.device, *, interval_s: float = 0.05) -> None:
        self._device, self._process = device, psutil.Process()
        self._cuda = device.type == "cuda"
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._phase: str | None = None
        self._peaks: dict[str, tuple[int, int]] = {}  # phase -> (largest reading, cached at that reading)
        self._tensors: dict[str, int] = {}
        self._held_at_start = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="memory-watch", daemon=True)
        self._thread.start()

    def _reading(self) -> tuple[int, int]:
        """(what the device holds, what torch's allocator keeps reserved and unallocated; 0 on CPU)."""
        if not self._cuda:
            return self._process.memory_info().rss, 0
        free, total = torch.cuda.mem_get_info(self._device)
        cached = torch.cuda.memory_reserved(self._device) - torch.cuda.memory_allocated(self._device)
        return total - free, cached

    def _read(self) -> None:
        reading = self._reading()
        with self._lock:
            if self._phase is not None and reading[0] > self._peaks.get(self._phase, (-1, 0))[0]:
                self._peaks[self._phase] = reading

    def _watch(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._read()
            except Exception:  # noqa: BLE001  a broken device: the loop's own read at its next phase raises it
                return

    def _end_phase(self) -> None:
        """The ending phase's tensors (CUDA), and torch's peak counter reset for the next."""
        if not self._cuda:
            return
        if self._phase is not None:
            grown = torch.cuda.max_memory_allocated(self._device) - self._held_at_start
            self._tensors[self._phase] = max(self._tensors.get(self._phase, 0), grown)
        torch.cuda.reset_peak_memory_stats(self._device)
        self._held_at_start = torch.cuda.memory_allocated(self._device)

    def start(self, phase: str) -> None:
        self._read()  # the moment between two phases counts for both
        self._end_phase()
        with self._lock:
            self._phase = phase
        self._read()

    def take(self) -> dict[str, float]:
        self._read()
        self._end_phase()
        with self._lock:
            peaks, tensors, self._peaks, self._tensors, self._phase = self._peaks, self._tensors, {}, {}, None
        out = {f"mem_{phase}_gib": used / GIB for phase, (used, _) in peaks.items()}
        if self._cuda:
            out |= {f"mem_{phase}_tensors_gib": held / GIB for phase, held in tensors.items()}
            out |= {f"mem_{phase}_cached_gib": cached / GIB for phase, (_, cached) in peaks.items()}
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
