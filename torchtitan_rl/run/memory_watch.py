"""The memory a step's phases held, measured from outside the allocators, beside the estimate (run/memory.py).

A daemon thread reads, every ``interval_s``, what this rank's device holds: on a GPU its total less its free bytes
as CUDA counts them (what nvidia-smi shows as used: every process and allocator on it, vLLM's sleep-mode pool and the
CUDA contexts included, which torch's own counters leave out or, after a sleep, overstate), on CPU this process's
resident memory. It keeps the largest reading of each phase; a peak shorter than the interval can be missed. The
loop starts it after the engine has captured its CUDA graphs: no reading runs beside a capture.
"""

import threading

import psutil
import torch

GIB = 1 << 30


class PhasePeaks:
    """``start(phase)`` names the phase the readings from now on belong to; ``take()`` ends the step's
    measurement and returns ``{"mem_<phase>_gib": the phase's largest reading}``. ``close()`` stops the thread."""

    def __init__(self, device: torch.device, *, interval_s: float = 0.05) -> None:
        self._device, self._process = device, psutil.Process()
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._phase: str | None = None
        self._peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="memory-watch", daemon=True)
        self._thread.start()

    def _used(self) -> int:
        if self._device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self._device)
            return total - free
        return self._process.memory_info().rss

    def _read(self) -> None:
        used = self._used()
        with self._lock:
            if self._phase is not None:
                self._peaks[self._phase] = max(self._peaks.get(self._phase, 0), used)

    def _watch(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._read()
            except Exception:  # noqa: BLE001  a broken device: the loop's own read at its next phase raises it
                return

    def start(self, phase: str) -> None:
        self._read()  # the moment between two phases counts for both
        with self._lock:
            self._phase = phase
        self._read()

    def take(self) -> dict[str, float]:
        self._read()
        with self._lock:
            peaks, self._peaks, self._phase = self._peaks, {}, None
        return {f"mem_{phase}_gib": used / GIB for phase, used in peaks.items()}

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
