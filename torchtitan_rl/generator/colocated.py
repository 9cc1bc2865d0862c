"""The colocated layout (weight_sync.transport = "inplace"): trainer rank 0 also holds the generator.

Every rank trains; rank 0's process also runs the vLLM engine, the sync
copies the trainer's tensors into it in place (WeightSync), and rank 0's
rollouts reach the other trainer ranks by one broadcast. The loop
(simple_grpo.py) sees the interface of generator/base.py, as for a generator
on its own rank (remote.py).

One process and one device do one thing at a time here, so ``submit``
generates at once, with the weights of that moment: with grpo.max_staleness
> 0 each batch is as old as on a generator of its own (same weights, same
samples), but nothing overlaps training.
"""

from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan_rl.config import JobConfig
from torchtitan_rl.generator.base import Done
from torchtitan_rl.generator.generator import Generator, Rollouts
from torchtitan_rl.models.shape import ModelShape
from torchtitan_rl.weight_sync import WeightSync


class ColocatedGenerator:
    """The generator in trainer rank 0's process; every trainer rank calls each method together."""

    def __init__(self, cfg: JobConfig, *, reference: dict[str, torch.Tensor], shape: ModelShape,
                 device: torch.device, workdir: Path) -> None:
        self.generator = None
        if dist.get_rank() == 0:
            self.generator = Generator(
                cfg.generator, model_config=cfg.model, shape=shape, seed=cfg.job.seed,
                device=device.type, workdir=workdir, batch_invariant=cfg.batch_invariant_mode,
            )
        try:
            self.weight_sync = WeightSync(
                cfg.weight_sync, reference=reference, generator=self.generator, lora=cfg.model.lora
            )
        except BaseException:
            self.close()
            raise

    def sync(self, state: dict[str, torch.Tensor], *, version: int) -> float:
        """Copy ``state`` into the generator, which then serves ``version``; seconds taken."""
        return self.weight_sync.sync(state, version=version).seconds

    def submit(self, prompts: list[list[int]], **generate_kwargs) -> Done:
        """Generate now (see above); every rank gets the rollouts."""
        return Done(self.rollouts(prompts, **generate_kwargs))

    def rollouts(self, prompts: list[list[int]], **generate_kwargs) -> Rollouts:
        """Generator.generate on rank 0 (``n``, ``stop_token_ids``, ``seed``); every rank gets the result."""
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
