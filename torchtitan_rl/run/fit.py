"""job.fit auto: a config changed, one lever at a time in a stated order, until its memory estimate fits the device.

``fit`` is a pure function of the config, the model shape, the run's size and the device's memory: every rank
computes the same answer before any process group exists (the last lever, trainer.cpu_offload, decides the
process group's backends). The loop prints its line; nothing changes when the run fits as configured.

The order (README, "Which layout for my model and GPUs"), cheapest first:
1. generator.sleep weights ('kv_cache' when weight_sync.enable is false): the engine's weights and KV cache leave
   the device while the trainer steps, and the gradients once it has stepped; samples are bitwise the same.
2. trainer.master_dtype bfloat16: half the trainer state (updates below bf16's resolution of a weight are lost).
3. trainer.micro_batch_tokens / recompute_micro_batch_tokens halved, down to one row of generator.max_model_len
   tokens: fewer activations, more micro-batches.
4. trainer.cpu_offload true: the trainer state goes to host memory and the optimizer steps on the CPU.
"""

import os
from dataclasses import dataclass

import torch

from torchtitan_rl.config import JobConfig
from torchtitan_rl.config.checks import replace
from torchtitan_rl.distributed.process_group import local_device
from torchtitan_rl.models.shape import ModelShape
from torchtitan_rl.run.memory import GIB, MemoryEstimate, estimate, micro_batch_tokens, trainer_ranks

BEYOND_AUTO = ("generator.gpu_memory_utilization (lower), trainer.activation_checkpoint full, "
               "trainer.logprob_chunk_tokens (lower), or more GPUs (layout b: python -m torchtitan_rl.launch on each; "
               "c: weight_sync.transport nccl)")
"""What makes room beyond auto's levers, named by its refusal."""

HEADROOM = 0.05
"""Share of the device auto leaves to what the estimate does not count: the CUDA context, NCCL's buffers and the
caching allocator's fragmentation."""


@dataclass(frozen=True)
class Fit:
    config: JobConfig
    """The config to run (the one given when nothing changed)."""
    changes: dict[str, object]
    """Field path -> new value, in the order applied."""
    estimate: MemoryEstimate
    """The estimate of ``config``."""
    line: str | None
    """What auto chose and why, one line; None when nothing changed."""


def fit(cfg: JobConfig, shape: ModelShape, *, world_size: int, role: str, device_total: int) -> Fit:
    """The config job.fit runs with on a device of ``device_total`` bytes (CUDA; 0 on CPU, where auto changes
    nothing: no sleep mode, nothing to offload to, and the host's free memory is every process's). ValueError in
    one line when even the last lever leaves the estimate above the device."""
    est = estimate(cfg, shape, world_size=world_size, device_total=device_total, role=role)
    budget = int((1 - HEADROOM) * device_total)
    if cfg.job.fit != "auto" or not device_total or role == "generator" or est.peak <= budget:
        return Fit(cfg, {}, est, None)
    first, changes = est, {}

    def fits() -> bool:
        return est.peak <= budget

    def apply(path: str, value) -> None:
        nonlocal cfg, est
        cfg = replace(cfg, path, value)
        changes[path] = value
        est = estimate(cfg, shape, world_size=world_size, device_total=device_total, role=role)

    inplace = cfg.weight_sync.transport == "inplace"
    if inplace and cfg.generator.sleep == "off" and not cfg.generator.overlap_training:  # it generates while training
        apply("generator.sleep", "weights" if cfg.weight_sync.enable else "kv_cache")
    if not fits() and cfg.trainer.master_dtype == "float32":
        apply("trainer.master_dtype", "bfloat16")
    rows = cfg.grpo.prompts_per_step * cfg.grpo.group_size // max(
        1, trainer_ranks(cfg, world_size) // cfg.trainer.parallelism.tensor_parallel_degree)
    floor = cfg.generator.max_model_len  # one row per micro-batch

    def smaller_micro_batches() -> None:
        while not fits():  # halve the budget of the phase over the device, while that lowers the peak
            before = est.peak
            train = micro_batch_tokens(cfg, rows=max(1, rows // cfg.grpo.mini_batches))
            recompute = micro_batch_tokens(cfg, rows=rows, recompute=True)
            if est.score_peak >= est.train_peak and recompute > floor:
                apply("trainer.recompute_micro_batch_tokens", max(floor, recompute // 2))
            elif est.train_peak > est.score_peak and train > floor:
                if not cfg.trainer.recompute_micro_batch_tokens:  # it followed micro_batch_tokens: keep its budget
                    apply("trainer.recompute_micro_batch_tokens", recompute)
                apply("trainer.micro_batch_tokens", max(floor, train // 2))
            if est.peak >= before:  # what is left does not shrink with the micro-batch (a logprob chunk, the state)
                return

    before_halving = (cfg, dict(changes), est)
    smaller_micro_batches()
    if not fits() and inplace and not cfg.trainer.cpu_offload:
        # Offloaded, the state leaves the device: the micro-batches may not need halving as far (or at all).
        cfg, changes, est = before_halving
        apply("trainer.cpu_offload", True)
        smaller_micro_batches()
    said = ", ".join(f"{path} {_value(v)}" for path, v in changes.items())
    g = lambda n: f"{n / GIB:.1f}"  # noqa: E731
    if not fits():
        raise ValueError(
            f"memory: this run needs at least {g(est.peak)} GiB per GPU even after job.fit auto set {said} "
            f"(estimate: {est.summary()}), and auto leaves {HEADROOM:.0%} of the {g(device_total)} GiB free; make room "
            f"with {BEYOND_AUTO}")
    line = (f"job.fit auto: {said}: the estimate's peak {g(first.peak)} GiB per GPU is above {g(budget)} of "
            f"{g(device_total)} GiB; now {g(est.peak)} (job.fit off keeps the config as written)")
    return Fit(cfg, changes, est, line)


def _value(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def fit_this_rank(cfg: JobConfig, shape: ModelShape, *, device: torch.device) -> Fit:
    """``fit`` for this process: its role in torchrun's world (RANK, WORLD_SIZE) and its device's size."""
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    role = "colocated" if cfg.weight_sync.transport == "inplace" else "trainer"  # a server's engine is elsewhere
    if cfg.weight_sync.transport == "nccl" and rank >= trainer_ranks(cfg, world_size):
        role = "generator"
    device = local_device(device)
    total = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else 0
    return fit(cfg, shape, world_size=world_size, role=role, device_total=total)
