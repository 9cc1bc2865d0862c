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

By default ``submit`` generates at once, with the weights of that moment:
with grpo.max_staleness > 0 each batch is as old as on a generator of its own
(same weights, same samples), but nothing overlaps training. With
generator.overlap_training a thread of each rank runs its engine, requests in
the order submitted, on a CUDA stream of its own, so the request made ahead
generates while the trainer trains on the GPU it shares; the rollouts are
shared between ranks (a collective) on the loop's thread, when it takes them,
and a sync first waits for the engine to finish what it was asked.
"""

import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan_rl import compat
from torchtitan_rl.config import JobConfig
from torchtitan_rl.engine.engine import SLEEP_LEVELS, Engine
from torchtitan_rl.rollout.base import Done, Later, Pending, Rollouts, block_request, prompt_blocks
from torchtitan_rl.models.shape import ModelShape
from torchtitan_rl.weight_sync.sync import WeightSync

SWITCH_INTERVAL_S = 0.001
"""Python's thread switch interval with generator.overlap_training (see ColocatedGenerator)."""


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
        self.engines = dist.get_world_size() if self.every_rank else 1
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
                    # a step in the worker thread never runs inside the trainer thread's compile
                    step_lock=compat.compile_lock() if cfg.generator.overlap_training else None,
                )
            if rank == 0:
                print("\n".join(self.generator.start_lines()), flush=True)
        self.worker = None
        """generator.overlap_training: the thread that runs this rank's engine, one request after another."""
        self.stream = None
        """The worker's CUDA stream: the engine's kernels run beside the trainer's, not after them."""
        self.running: list[Future] = []
        """The requests handed to the worker and not yet waited for by a sync."""
        if cfg.generator.overlap_training:
            cuda = device.type == "cuda"
            if cuda and self.generator is not None:
                self.stream = torch.cuda.Stream(device)
                compat.run_engine_on(self.generator.engine, self.stream)
            # A thread's current CUDA device starts at 0: the worker's is this rank's.
            self.worker = ThreadPoolExecutor(1, thread_name_prefix="generator",
                                             initializer=torch.cuda.set_device if cuda else None,
                                             initargs=(device,) if cuda else ())
            # The engine's thread waits for the interpreter at each step's host work: a shorter switch interval
            # (Python's default 5 ms) bounds that wait while the trainer's thread launches kernels.
            self.switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        try:
            self.weight_sync = WeightSync(
                cfg.weight_sync, reference=reference, generator=self.generator, lora=cfg.model.lora,
                gather_device=device if cfg.trainer.cpu_offload else None,
            )
        except BaseException:
            self.close()
            raise

    def sync(self, state: dict[str, torch.Tensor], *, version: int) -> float:
        """Copy ``state`` into the generator, which then serves ``version``; seconds taken (after the requests
        in flight, which read the weights it writes, have finished)."""
        self._drain()
        return self.weight_sync.sync(state, version=version).seconds

    def _drain(self) -> None:
        """Wait for the worker's requests; one that failed raises here, before anything else is asked of it."""
        running, self.running = self.running, []
        for future in running:
            future.result()

    def sleep(self) -> None:
        """generator.sleep: free the engines' memory while the trainer steps (every rank together); the next
        sync wakes them, and after level 2 rewrites and verifies every tensor before anything is served."""
        if not self.sleep_level:
            return
        assert self.worker is None, "generator.overlap_training runs with generator.sleep off (validation)"
        if self.generator is not None:
            self.generator.sleep(self.sleep_level)
        if self.sleep_level == 2:
            self.weight_sync.weights_discarded()

    def submit(self, prompts: list[list[int]], **generate_kwargs) -> Pending:
        """Engine.generate (``n``, ``stop_token_ids``, ``seed``) on this rank's block of ``prompts``, or on
        rank 0 for all of them; every rank gets the whole batch, blocks in rank order. Now, or with
        generator.overlap_training in the worker, after the requests before it (see above)."""
        if self.worker is None:
            return Done(self._share(self._own_part(prompts, generate_kwargs)))
        ready = None
        if self.stream is not None:  # the worker's stream starts after what this thread queued (a sync's writes)
            ready = torch.cuda.Event()
            ready.record()
        future = self.worker.submit(self._in_worker, prompts, generate_kwargs, ready)
        self.running.append(future)
        return Later(lambda: self._share(future.result()))

    def rollouts(self, prompts: list[list[int]], **generate_kwargs) -> Rollouts:
        """``submit(...).result()``."""
        return self.submit(prompts, **generate_kwargs).result()

    def _in_worker(self, prompts: list[list[int]], generate_kwargs: dict, ready: torch.cuda.Event | None,
                   ) -> Rollouts | None:
        if self.stream is None:
            return self._own_part(prompts, generate_kwargs)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            part = self._own_part(prompts, generate_kwargs)
        self.stream.synchronize()  # a sync after this writes weights no kernel of the stream still reads
        return part

    def _own_part(self, prompts: list[list[int]], generate_kwargs: dict) -> Rollouts | None:
        """This rank's engine's rollouts for the request: its block, or the whole on rank 0; None without one."""
        if self.every_rank:
            a, b = prompt_blocks(len(prompts), self.engines)[dist.get_rank()]
            block, kwargs = block_request(prompts, generate_kwargs, a, b)
            return self.generator.generate(block, **kwargs)
        return None if self.generator is None else self.generator.generate(prompts, **generate_kwargs)

    def _share(self, part: Rollouts | None) -> Rollouts:
        """Every rank's part to every rank (a collective: the loop's thread, in request order)."""
        if self.every_rank:
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, part)
            return Rollouts.concat(parts)
        payload = [part]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def close(self) -> None:
        """Shut the engine down now, not at a garbage collection in the middle of something else (a generate
        still running in the worker stops at its next engine step)."""
        if self.worker is not None:
            for future in self.running:
                future.cancel()
            if self.generator is not None:
                self.generator.interrupt()
            self.worker.shutdown(wait=True)
            self.worker = None
            sys.setswitchinterval(self.switch_interval)
        if self.generator is not None:
            self.generator.close()
            self.generator = None
