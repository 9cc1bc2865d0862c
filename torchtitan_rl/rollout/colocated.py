"""The colocated layout (weight_sync.transport = "inplace"): the trainer ranks also hold the generator.

Every rank trains. With generator.colocated_ranks = "all" (the default) every
trainer rank's process also runs a vLLM engine on its own device, next to its
shard of the trainer: the sync gathers each bucket of full tensors on every
rank (the all-gather FSDP needs anyway) and each rank copies it into its own
engine in place (WeightSync); a request's prompts are split in contiguous
blocks, one per rank, each seeded by global prompt index (so the samples do
not depend on the number of ranks), and one all-gather gives every rank the
whole batch. With "first" only rank 0 holds an engine and broadcasts its
rollouts (less memory on the other ranks, T - 1 devices idle while it
generates). The loop (simple_grpo.py) sees the interface of
rollout/base.py, as for a generator on its own rank (remote.py).

One process and one device do one thing at a time here, so ``submit``
generates at once, with the weights of that moment: with grpo.max_staleness
> 0 each batch is as old as on a generator of its own (same weights, same
samples), but nothing overlaps training.
"""

from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan_rl import compat
from torchtitan_rl.config import JobConfig
from torchtitan_rl.engine.engine import SLEEP_LEVELS, Engine
from torchtitan_rl.rollout.base import Done, Rollouts, block_request, prompt_blocks
from torchtitan_rl.models.shape import ModelShape
from torchtitan_rl.weight_sync.sync import WeightSync


class ColocatedGenerator:
    """The generator in the trainer ranks' processes; every trainer rank calls each method together."""

    def __init__(self, cfg: JobConfig, *, reference: dict[str, torch.Tensor], shape: ModelShape,
                 device: torch.device, workdir: Path, kv_cache_bytes: int) -> None:
        """``kv_cache_bytes``: each engine's KV cache (the run's memory estimate, run/memory.py): required, as
        vLLM's own sizing miscounts in a process the trainer shares."""
        self.generator = None
        rank = dist.get_rank()
        self.sleep_level = SLEEP_LEVELS[cfg.generator.sleep]
        self.every_rank = cfg.generator.colocated_ranks == "all" and dist.get_world_size() > 1
        """Each rank generates a block of every request; else rank 0 generates it all."""
        if device.type == "cuda" and dist.get_world_size() > 1 and not self.every_rank:
            # vLLM's group setup is a collective the ranks without an engine never join (docs/design.md, "Why the code
            # looks this way").
            raise ValueError(
                "generator.colocated_ranks: 'first' hangs rank 0's vLLM engine at start when other trainer ranks "
                "hold no engine on CUDA; use 'all' (every rank generates), or weight_sync.transport nccl"
            )
        if rank == 0 or self.every_rank:
            with compat.vllm_device(device):  # this rank's GPU, not cuda:0
                self.generator = Engine(
                    cfg.generator, model_config=cfg.model, shape=shape, seed=cfg.job.seed, device=device.type,
                    # each engine writes its config.json into a folder of its own
                    workdir=workdir if rank == 0 else Path(workdir) / f"rank{rank}",
                    batch_invariant=cfg.batch_invariant_mode, kv_cache_bytes=kv_cache_bytes,
                )
            if rank == 0:
                print("\n".join(self.generator.start_lines()), flush=True)
        try:
            self.weight_sync = WeightSync(
                cfg.weight_sync, reference=reference, generator=self.generator, lora=cfg.model.lora,
                gather_device=device if cfg.trainer.cpu_offload else None,
            )
        except BaseException:
            self.close()
            raise

    def sync(self, state: dict[str, torch.Tensor], *, version: int) -> float:
        """Copy ``state`` into the generator, which then serves ``version``; seconds taken."""
        return self.weight_sync.sync(state, version=version).seconds

    def sleep(self) -> None:
        """generator.sleep: free the engines' memory while the trainer steps (every rank together); the next
        sync wakes them, and after level 2 rewrites and verifies every tensor before anything is served."""
        if not self.sleep_level:
            return
        if self.generator is not None:
            self.generator.sleep(self.sleep_level)
        if self.sleep_level == 2:
            self.weight_sync.weights_discarded()

    def submit(self, prompts: list[list[int]], **generate_kwargs) -> Done:
        """Generate now (see above); every rank gets the rollouts."""
        return Done(self.rollouts(prompts, **generate_kwargs))

    def rollouts(self, prompts: list[list[int]], **generate_kwargs) -> Rollouts:
        """Engine.generate (``n``, ``stop_token_ids``, ``seed``) on this rank's block of ``prompts``, or on
        rank 0 for all of them; every rank gets the whole batch, blocks in rank order."""
        if self.every_rank:
            a, b = prompt_blocks(len(prompts), dist.get_world_size())[dist.get_rank()]
            block, kwargs = block_request(prompts, generate_kwargs, a, b)
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, self.generator.generate(block, **kwargs))
            return Rollouts.concat(parts)
        payload = [None]
        if self.generator is not None:
            payload = [self.generator.generate(prompts, **generate_kwargs)]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def close(self) -> None:
        """Shut the engine down now, not at a garbage collection in the middle of something else."""
        if self.generator is not None:
            self.generator.close()
            self.generator = None
