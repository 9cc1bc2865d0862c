"""Process topology: which torchrun ranks train and which generate, and the groups that join them.

The layout is one torchrun world of T + R processes: ranks 0..T-1 train, the
last R ranks each hold one generator replica (vLLM in process, on its own
device). ``init_world`` sets it up so that nothing in the trainer changes:

- the trainer ranks' *default* process group spans the trainer ranks only,
  so FSDP/ParallelDims (built on the default world), the trainer's own
  collectives and WeightSync's validation all-reduces run as they do
  without generator ranks; each generator's default group is itself alone,
  and vLLM builds its groups on that;
- trainer rank 0 and every generator rank share one group (``group``: R + 1
  ranks, built directly on the job's store) that carries the weights: each
  bucket is ONE broadcast from trainer rank 0 to all replicas, never one
  send per replica (NCCL pipelines it down a chain or tree: the sender's
  link carries the bytes once, whatever R);
- metadata goes through the job's TCP store: the trainer's key/shape/dtype
  list at startup (each replica builds its own sync plan and coverage proof
  from it, and answers with the dtype it wants each tensor in), one header
  per sync, read by every replica, and each replica's answer after it (the
  sender waits for all R). Nothing waits inside NCCL between syncs, so no
  NCCL timeout runs while the trainer trains.
"""

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from torchtitan_rl import compat
from torchtitan_rl.distributed.process_group import local_device

STORE_PREFIX = "torchtitan_rl/weight_sync"
"""Prefix of this package's keys in the job's store (every rank of a job must use the same)."""


@dataclass
class World:
    """Where this process sits: a trainer rank or one of the generator replicas."""

    role: str
    """"trainer" or "generator"."""
    rank: int
    """torchrun rank (also the default-group rank on trainer ranks; 0 there on a generator)."""
    trainer_ranks: int
    device: torch.device
    store: dist.Store
    """The job's store (torchrun's), for metadata."""
    group: object | None
    """c10d backend of the weight broadcast: trainer rank 0 is its rank 0, replica r its rank 1 + r; None on
    the other trainer ranks."""
    replicas: int = 1
    """Engine replicas (the last ``replicas`` torchrun ranks)."""
    replica: int = 0
    """Engine side: this replica's index, 0..replicas-1 (its prompts block, its store keys)."""

    @property
    def sender(self) -> bool:
        return self.role == "trainer" and self.rank == 0


def init_world(device_type: str, *, replicas: int = 1, timeout_s: float = 3600.0,
               weight_timeout_s: float = 1800.0) -> World:
    """Join torchrun's world as a trainer rank or as one of ``replicas`` generator ranks (the last ones).

    The trainer ranks' default process group spans the trainer ranks only: the
    Trainer then reuses it (``init_process_group`` keeps an existing group), so
    its meshes, FSDP and every default-group collective exclude the generators
    without a line of trainer code knowing. Each generator rank's default group
    is itself alone; its vLLM engine builds its groups on it. ``timeout_s``
    (trainer.collective_timeout_s) bounds each collective of the default groups,
    ``weight_timeout_s`` (weight_sync.peer_timeout_s) each of the weight group.
    """
    assert not dist.is_initialized(), "init_world must create the process groups"
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size < replicas + 1:
        raise ValueError(f"weight_sync.transport=nccl: needs >= {replicas + 1} ranks (trainers + {replicas} "
                         f"generator replicas), got {world_size}")
    trainers = world_size - replicas
    store, _, _ = next(dist.rendezvous("env://"))
    device = local_device(device_type)  # this machine's GPU LOCAL_RANK: RANK counts the GPUs of every machine
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    role = "generator" if rank >= trainers else "trainer"
    replica = rank - trainers if role == "generator" else 0
    # Trainer ranks: a default group of the trainer ranks. A generator: a default
    # group of its own, which vLLM then reuses. Left to vLLM, its one-rank
    # init_process_group("tcp://...") would, under torchrun
    # (TORCHELASTIC_USE_AGENT_STORE=1), connect as a client to a store nobody
    # serves and wait until its timeout.
    group_rank, group_size = (rank, trainers) if role == "trainer" else (0, 1)
    prefix = f"{STORE_PREFIX}/trainer" if role == "trainer" else f"{STORE_PREFIX}/generator/{replica}"
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=dist.PrefixStore(prefix, store),
        rank=group_rank, world_size=group_size, device_id=device if cuda else None,
        timeout=timedelta(seconds=timeout_s),
    )
    group = None
    if rank == 0 or role == "generator":
        group = broadcast_group(dist.PrefixStore(f"{STORE_PREFIX}/weights", store), rank=0 if rank == 0 else 1 + replica,
                                size=1 + replicas, device=device, timeout_s=weight_timeout_s)
    return World(role, rank, trainers, device, store, group, replicas=replicas, replica=replica)


def broadcast_group(store: dist.Store, *, rank: int, size: int, device: torch.device, timeout_s: float = 1800.0):
    """The c10d group of trainer rank 0 (rank 0) and ``size - 1`` generators (ranks 1..) on ``store``.

    Returns once every member joined and the communicator exists. It is
    created before the generators' vLLM engines where possible: vLLM's
    batch-invariant mode sets NCCL_PROTO=Simple, one channel, etc. in its
    process, and a communicator created after that would not match the
    trainer's (the first sync hangs).
    ``timeout_s`` bounds each collective: on gloo a peer that died mid-sync
    raises at once (its socket closes); on NCCL nothing notices before the
    timeout, and torch's NCCL watchdog then ends the process (nothing waits
    inside NCCL between syncs, so only a sync can time out).
    """
    if device.type == "cuda":
        group = compat.nccl_process_group(store, rank, size, timedelta(seconds=timeout_s))
    else:
        group = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))
    broadcast(group, torch.zeros(1, device=device), root=0).wait()
    return group


def pair_group(store: dist.Store, *, rank: int, device: torch.device, timeout_s: float = 1800.0):
    """``broadcast_group`` of trainer rank 0 (rank 0) and one generator (rank 1): the rollout server's."""
    return broadcast_group(store, rank=rank, size=2, device=device, timeout_s=timeout_s)


def broadcast(group, tensor: torch.Tensor, root: int):
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    return group.broadcast([tensor], opts)
