"""What a run will hold in device memory, said before it starts; a run that cannot fit refused in one line.

The estimate counts what is certain (the trainer's parameters, gradients and AdamW state per rank, by dtype,
FSDP degree and offload; the engine's weights and the KV-cache budget vLLM takes) and leaves out what depends
on the batch (activations, logits chunks): a refusal from it is never a false alarm, and a run it admits may
still meet CUDA's refusal in the first step, which ``one_line_oom`` turns into the same one line.
"""

import contextlib
from dataclasses import dataclass

import torch

from torchtitan_rl.config import JobConfig
from torchtitan_rl.engine.engine import SLEEP_LEVELS
from torchtitan_rl.models.lora import apply_lora
from torchtitan_rl.models.shape import ModelShape, titan_config

GIB = 1 << 30

LEVERS = ("generator.gpu_memory_utilization (lower), generator.sleep 'weights', trainer.cpu_offload true or "
          "trainer.master_dtype bfloat16, trainer.micro_batch_size / micro_batch_tokens (lower), or more GPUs "
          "(layout b: torchrun on each; c: weight_sync.transport nccl)")
"""The fields that make room on a GPU, named by every refusal there."""

CPU_LEVERS = ("trainer.master_dtype bfloat16, generator.kv_cache_memory_gb (lower), trainer.micro_batch_size / "
              "micro_batch_tokens (lower), or a smaller model.flavor")
"""The same on CPU (no sleep mode, nothing to offload to)."""

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def count_parameters(shape: ModelShape, lora=None) -> tuple[int, int, int]:
    """(all parameters, trainable ones, the largest decoder block's), counted on a meta-device model."""
    with torch.device("meta"):
        model = titan_config(shape).build()
        if lora is not None and lora.rank:
            apply_lora(model, lora)
    params = list(model.parameters())  # a tied embedding is one Parameter, counted once
    block = max(sum(p.numel() for p in b.parameters()) for b in model.layers.values())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad), block


@dataclass
class MemoryEstimate:
    """Bytes per GPU (per rank) of one run; ``device_total`` 0 on CPU (no budget to check against)."""

    params: int
    """Parameters of the model (trainable ones in ``trainable``)."""
    trainable: int
    shards: int
    """Ranks each trainer tensor is split over (FSDP degree x tensor-parallel degree)."""
    master_dtype: str
    offload: bool
    trainer_params: int
    """This rank's share of the master weights (in host memory with trainer.cpu_offload)."""
    trainer_grads: int
    trainer_adam: int
    trainer_reference: int
    """The frozen reference policy's weights (grpo.kl_coef > 0), sharded as the trainer's."""
    trainer_gathered: int
    """Blocks FSDP holds unsharded in the compute dtype during forward/backward (the current and the prefetched)."""
    engine_weights: int
    engine_budget: int
    """What the engine takes on its device: its weights plus KV cache (on CUDA generator.gpu_memory_utilization of
    the device, all of it vLLM's to hold)."""
    engine_while_training: int
    """What the engine keeps on the device while the trainer steps (0 asleep)."""
    grads_freed: bool
    """The gradients are freed after each step (generator.sleep), not kept through the next generation."""
    device_total: int
    role: str
    """colocated (trainer and engine on each GPU), trainer or generator (weight_sync.transport nccl)."""
    kv_token_bytes: int
    """KV-cache bytes of one token (layers x 2 x KV heads x head_dim x the compute dtype's bytes)."""
    max_model_len: int
    max_num_seqs: int

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV-cache budget could hold (an upper bound: vLLM also keeps activations and CUDA graphs in
        its budget; the engine's own count is printed once it is built)."""
        return (self.engine_budget - self.engine_weights) // self.kv_token_bytes

    @property
    def trainer_host(self) -> int:
        return self.trainer_params + self.trainer_grads + self.trainer_adam + self.trainer_reference \
            if self.offload else 0

    @property
    def trainer_resident(self) -> int:
        """Trainer bytes on the device from the first step on: master weights, gradients (kept until the next step
        zeroes them), AdamW state and a reference policy."""
        return 0 if self.offload else (self.trainer_params + self.trainer_grads + self.trainer_adam
                                       + self.trainer_reference)

    @property
    def generate_peak(self) -> int:
        trainer = self.trainer_resident - (self.trainer_grads if self.grads_freed and not self.offload else 0)
        return (trainer if self.role != "generator" else 0) + (self.engine_budget if self.role != "trainer" else 0)

    @property
    def train_peak(self) -> int:
        if self.role == "generator":
            return 0
        engine = self.engine_while_training if self.role == "colocated" else 0
        return self.trainer_resident + self.trainer_gathered + engine

    @property
    def peak(self) -> int:
        return max(self.generate_peak, self.train_peak)

    def summary(self) -> str:
        """One line for the start of a run."""
        g = lambda n: f"{n / GIB:.1f}"  # noqa: E731
        where = "host" if self.offload else "device"
        parts = [f"memory per {'GPU' if self.device_total else 'rank'} (estimate, activations not counted):"]
        if self.role != "generator":
            parts.append(
                f"trainer {self.params / 1e9:.2f}B params / {self.shards} ranks in {self.master_dtype}: weights "
                f"{g(self.trainer_params)} + grads {g(self.trainer_grads)} + AdamW {g(self.trainer_adam)} + "
                f"reference {g(self.trainer_reference)} GiB on {where}, gathered blocks {g(self.trainer_gathered)};")
        if self.role != "trainer":
            parts.append(f"engine {g(self.engine_budget)} GiB (weights {g(self.engine_weights)} + KV cache "
                         f"{g(self.engine_budget - self.engine_weights)}: at most {self.kv_tokens} tokens, "
                         f"{self.kv_tokens // self.max_model_len} sequences of max_model_len {self.max_model_len} "
                         f"beside max_num_seqs {self.max_num_seqs}), {g(self.engine_while_training)} while "
                         "the trainer steps;")
        parts.append(f"peak {g(self.peak)} GiB (generate {g(self.generate_peak)}, train {g(self.train_peak)})")
        if self.device_total:
            parts.append(f"of {g(self.device_total)}, {g(self.device_total - self.peak)} left")
        return " ".join(parts)


def estimate(cfg: JobConfig, shape: ModelShape, *, world_size: int, device_total: int, role: str) -> MemoryEstimate:
    """The estimate for one rank of ``role`` in a run of ``world_size`` processes (a validated config)."""
    params, trainable, block = count_parameters(shape, cfg.model.lora)
    trainer_world = world_size - (cfg.generator.parallelism.data_parallel_replicate_degree
                                  if cfg.weight_sync.transport == "nccl" else 0)
    par = cfg.trainer.parallelism
    shards = max(1, trainer_world // par.data_parallel_replicate_degree)  # FSDP x TP ranks split each tensor
    master = _BYTES[cfg.trainer.master_dtype]
    compute = _BYTES[cfg.model.dtype]
    engine_weights = params * compute
    on_cuda = device_total > 0
    engine_budget = (int(cfg.generator.gpu_memory_utilization * device_total) if on_cuda
                     else engine_weights + int(cfg.generator.kv_cache_memory_gb * GIB))
    asleep = SLEEP_LEVELS[cfg.generator.sleep] > 0
    return MemoryEstimate(
        params=params, trainable=trainable, shards=shards, master_dtype=cfg.trainer.master_dtype,
        offload=cfg.trainer.cpu_offload and on_cuda,
        trainer_params=-(-params * master // shards), trainer_grads=-(-trainable * master // shards),
        trainer_adam=-(-2 * trainable * master // shards), trainer_gathered=2 * block * compute,
        trainer_reference=-(-params * master // shards) if cfg.grpo.kl_coef > 0 else 0,
        engine_weights=engine_weights, engine_budget=max(engine_budget, engine_weights),
        engine_while_training=0 if asleep else max(engine_budget, engine_weights), grads_freed=asleep,
        device_total=device_total, role=role, max_model_len=cfg.generator.max_model_len,
        kv_token_bytes=shape.num_hidden_layers * 2 * shape.num_key_value_heads * shape.head_dim * compute,
        max_num_seqs=cfg.generator.max_num_seqs,
    )


def host_available() -> int:
    """Bytes of host memory the kernel can give without swapping (MemAvailable)."""
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) << 10
    raise AssertionError("/proc/meminfo has no MemAvailable")


def check_fits(est: MemoryEstimate, *, free: int, device: str) -> None:
    """ValueError in one line when what the estimate counts already exceeds ``free`` bytes of ``device`` (on CPU:
    host memory)."""
    if est.peak > free:
        raise ValueError(
            f"memory: this run needs at least {est.peak / GIB:.1f} GiB on {device} ({est.summary()}), which has "
            f"{free / GIB:.1f} GiB free; make room with {LEVERS if est.device_total else CPU_LEVERS}")


@contextlib.contextmanager
def one_line_oom(where: str):
    """CUDA's refusal (torch.OutOfMemoryError) at ``where``, or the CPU allocator's, as one ValueError line naming
    the fields to change."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        first = str(e).splitlines()[0] if str(e) else "out of memory"
        raise ValueError(f"memory: CUDA ran out of memory at {where} ({first[:160]}); make room with {LEVERS}") \
            from None
    except RuntimeError as e:
        if "can't allocate memory" not in str(e):  # torch's CPU allocator: a RuntimeError, not OutOfMemoryError
            raise
        raise ValueError(f"memory: the host ran out of memory at {where} ({str(e).splitlines()[0][-120:]}); make "
                         f"room with {CPU_LEVERS}") from None
