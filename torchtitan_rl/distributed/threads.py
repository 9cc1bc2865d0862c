"""How many CPU threads each process of a run uses (job.host_threads): processes sharing a host split its cores.

Left alone, torch sizes its intra-op pool (OpenMP) to every core of the host in every process, and inductor its
compile workers likewise: two ranks, or two one-GPU runs, on one host then each spin a thread per core on the
same cores. Here each process gets the cores it may use (its affinity and its cgroup's quota) divided by the
processes sharing them: torchrun's local ranks, or on a GPU host its GPUs (one process per GPU), whichever is
more. An OMP_NUM_THREADS the user set is kept, torchrun's 1 for several local ranks too, unless torchtitan_rl.launch
started the ranks: it says the 1 is torchrun's (``TORCHRUN_OMP``), and a rank then takes its share (a rank held
to one thread runs the CPU optimizer of trainer.cpu_offload and the sync's checks of host-memory shards on one core).
"""

import contextlib
import os
from collections.abc import Iterator, Mapping

import torch

from torchtitan_rl import compat

TORCHRUN_OMP = "TORCHTITAN_RL_OMP_FROM_TORCHRUN"
"""Set by torchtitan_rl.launch when OMP_NUM_THREADS was not set: torchrun's agent then sets it to 1 for several
local ranks, which is not a user's choice."""


def host_threads(setting: int, *, cpus: int, local_ranks: int, host_gpus: int,
                 environ: Mapping[str, str]) -> int | None:
    """The threads of one process; None leaves torch's and vLLM's defaults (``setting`` -1)."""
    if setting < 0:
        return None
    if setting > 0:
        return setting
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0 and not environ.get(TORCHRUN_OMP):
        return int(omp)
    return max(1, cpus // max(1, local_ranks, host_gpus))


def usable_cpus() -> int:
    """Cores this process may run on: its affinity, capped by its cgroup's CPU quota (cgroup v2 cpu.max)."""
    count = len(os.sched_getaffinity(0))
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
        if quota != "max":
            count = min(count, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return count


def host_gpu_count() -> int:
    """GPUs of this host, whatever CUDA_VISIBLE_DEVICES shows this process (NVML counts them all)."""
    try:
        import pynvml  # nvidia-ml-py, a dependency of vLLM's CUDA build

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001  no NVML (a CPU machine, or a driver without it): what CUDA shows
        return torch.cuda.device_count() if torch.cuda.is_available() else 0


def set_host_threads(setting: int, *, device_type: str) -> int | None:
    """Apply ``host_threads`` to this process: torch's intra-op threads, OMP_NUM_THREADS (vLLM then keeps torch's
    threads at it instead of its serving default of one, and child processes such as inductor's compile workers
    read it) and inductor's compile workers (unless TORCHINDUCTOR_COMPILE_THREADS is set). Returns the count (None:
    defaults kept)."""
    n = host_threads(setting, cpus=usable_cpus(), local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                     host_gpus=host_gpu_count() if device_type == "cuda" else 0, environ=os.environ)
    if n is None:
        return None
    os.environ["OMP_NUM_THREADS"] = str(n)
    compat.set_num_threads(n)
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:  # a user's own setting is kept
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(n)
        compat.set_compile_threads(n)
    return n


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads at ``n`` inside, the process's count again after; ``n`` 0: unchanged."""
    before = torch.get_num_threads()
    if n:
        compat.set_num_threads(n)
    try:
        yield
    finally:
        if n:
            compat.set_num_threads(before)
