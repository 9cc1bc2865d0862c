"""Process group and torchtitan ParallelDims for the trainer (determinism flags: distributed/determinism.py).

The trainer always runs inside a process group, also as a single process:
FSDP then wraps the model the same way at every world size, so one process
and many compute with the same bf16 copies of the fp32 master weights.
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from torchtitan_rl import compat
from torchtitan_rl.config.job_config import ParallelismConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.utils import set_spmd_backend


def local_device(device: torch.device | str) -> torch.device:
    """The device with an index on CUDA: torchrun's LOCAL_RANK when none is given (the rank's place on its own
    machine; RANK counts every machine's ranks, and rank 3 of two 2-GPU machines is GPU 1 of the second)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return device


def init_process_group(device: torch.device, *, timeout_s: float = 3600.0, cpu_tensors: bool = False) -> None:
    """Join torchrun's process group, or start a one-process group; reuse one that exists.

    ``timeout_s`` (trainer.collective_timeout_s) bounds each collective of the default group, where the
    other trainer ranks wait while rank 0 generates and scores; torch's default would be 10 min on NCCL.
    """
    if dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    backend, device_id = "gloo", None
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # trainer.cpu_offload: sharded state lives on the CPU, and its collectives (gradient norm, the sync's
        # checks) need a backend for CPU tensors beside NCCL, as torchtitan's own offload does.
        backend, device_id = "cuda:nccl,cpu:gloo" if cpu_tensors else "nccl", device
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, device_id=device_id, timeout=timeout)
        return
    # Not launched by torchrun: a private store on a free local port (port 0).
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, device_id=device_id, timeout=timeout)


def build_parallel_dims(
    parallelism: ParallelismConfig, *, world_size: int, device: torch.device
) -> ParallelDims:
    """torchtitan's ParallelDims for the trainer's degrees, checked against the world size."""
    path = "trainer.parallelism"
    shard = parallelism.data_parallel_shard_degree
    replicate, tp = parallelism.data_parallel_replicate_degree, parallelism.tensor_parallel_degree
    if shard != -1 and shard < 1:
        raise ValueError(f"{path}.data_parallel_shard_degree: must be -1 or >= 1, got {shard}")
    for name, value in (("data_parallel_replicate_degree", replicate), ("tensor_parallel_degree", tp)):
        if value < 1:
            raise ValueError(f"{path}.{name}: must be >= 1, got {value}")
    if shard == -1:
        if world_size % (replicate * tp):
            raise ValueError(
                f"{path}: data_parallel_replicate_degree ({replicate}) * tensor_parallel_degree "
                f"({tp}) does not divide world size {world_size}"
            )
        shard = world_size // (replicate * tp)
    if shard * replicate * tp != world_size:
        raise ValueError(
            f"{path}: data_parallel_shard_degree ({shard}) * data_parallel_replicate_degree "
            f"({replicate}) * tensor_parallel_degree ({tp}) != world size {world_size}"
        )
    compat.titan_mesh_device_type(device.type)
    # torchtitan's runtime helpers (the MoE token dispatcher's all-to-all) read the backend from this global,
    # whose default is "spmd_types"; torchtitan's Trainer sets it the same way.
    set_spmd_backend("partial_dtensor")
    dims = ParallelDims(
        dp_replicate=replicate, dp_shard=shard, cp=1, tp=tp, pp=1, ep=parallelism.expert_parallel_degree,
        world_size=world_size,
        # The DTensor-only path: FSDP2 over a "fsdp" mesh that torchtitan keeps
        # real even at degree 1, TP through the model's own parallelize().
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    return dims
