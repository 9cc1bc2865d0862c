"""What a run will hold in device memory, said before it starts; a run that cannot fit refused in one line.

The estimate counts the trainer's parameters, gradients and AdamW state per rank (by dtype, FSDP degree and
offload), the activations of its largest micro-batch (forward + backward, and the logprob recompute's no-grad
forward) from the trainer's settings, and the engine: its weights and KV-cache budget while it generates, its
CUDA graphs while it sleeps. The activation terms are upper bounds of torchtitan's eager decoder measured on CPU
(tests/trainer/test_memory_estimate.py); a run it admits may still meet CUDA's refusal (fragmentation, kernels'
workspaces), which ``one_line_oom`` turns into the same one line. run/fit.py changes a config until it fits.
The estimate counts tensors, not the blocks torch's allocator keeps reserved between them: training processes run
it with expandable segments (run/startup.py), where its default kept blocks of earlier micro-batches' shapes that
outgrew the recompute's own tensors (docs/benchmarks.md, "The long tail (cuda)").
"""

import contextlib
from dataclasses import dataclass

import torch

from torchtitan_rl.config import JobConfig
from torchtitan_rl.engine.engine import SLEEP_LEVELS
from torchtitan_rl.models.lora import apply_lora
from torchtitan_rl.models.shape import ModelShape, titan_config
from torchtitan_rl.trainer.build import block_dtype, reads_hf_shards

GIB = 1 << 30

LEVERS = ("job.fit auto, generator.gpu_memory_utilization (lower), generator.sleep 'weights', trainer.cpu_offload "
          "true or trainer.master_dtype bfloat16, trainer.micro_batch_tokens / recompute_micro_batch_tokens (lower), "
          "trainer.activation_checkpoint full, or more GPUs (layout b: torchrun on each; c: weight_sync.transport "
          "nccl)")
"""The fields that make room on a GPU, named by every refusal there."""

CPU_LEVERS = ("trainer.master_dtype bfloat16, generator.kv_cache_memory_gb (lower), trainer.micro_batch_size / "
              "micro_batch_tokens / recompute_micro_batch_tokens (lower), trainer.activation_checkpoint full, or a "
              "smaller model.flavor")
"""The same on CPU (no sleep mode, nothing to offload to)."""

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

BACKWARD_PEAK = 1.2
"""A block's backward (recomputed under activation checkpointing) holds its saved activations and the gradients
of its intermediates at once: up to this many times its saved bytes per token (1.1 measured on CPU for torchtitan's
debugmodel; tests/trainer/test_memory_estimate.py checks the bound)."""
LOGITS_BYTES = {False: 24, True: 8}
"""Bytes per logit of one logprob chunk at its backward's peak (trainer/logprobs.py): eager keeps bf16 logits, their
float32 copies, softmax and its gradient at once (an upper bound on CPU); torch.compile (trainer.compile, on GPUs)
fuses them into a few passes over the bf16 logits (8: not measured, checked by the GPU rows' peaks)."""
GRAPH_BYTES = 4 << 20
"""What one captured CUDA graph of the engine keeps besides the shared pool (vLLM 0.26; calibrated by
scripts/gpu/one_gpu.sh's rows)."""
PROFILE_TOKENS = 2048
"""Tokens of the forward vLLM profiles an engine with: its max_num_batched_tokens, 2048 for an ``LLMEngine`` built
from EngineArgs with chunked prefill (vLLM 0.26's default outside the LLM class and the server)."""
SAMPLER_BYTES = 12
"""Bytes per logit of vLLM's profiled sampler step over one logit row per sequence (logits, their float32 copy,
the top-k/top-p sort): the profile's torch peak of Qwen3-4B at 512 sequences was 0.74 GiB, 10.2 a logit."""


def count_parameters(shape: ModelShape, lora=None) -> tuple[int, int, int]:
    """(all parameters, trainable ones, the largest decoder block's), counted on a meta-device model."""
    with torch.device("meta"):
        model = titan_config(shape).build()
        if lora is not None and lora.rank:
            apply_lora(model, lora)
    params = list(model.parameters())  # a tied embedding is one Parameter, counted once
    block = max(sum(p.numel() for p in b.parameters()) for b in model.layers.values())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad), block


def block_saved_bytes(shape: ModelShape, compute: int) -> int:
    """Bytes per token one decoder block's forward saves for its backward (torchtitan's eager Qwen3/Llama block;
    ``compute`` bytes per element of model.dtype): the norms' float32 inputs, q/k in float32 for RoPE, q, k, v
    and the attention output, the feed-forward's four intermediates."""
    q = shape.num_attention_heads * shape.head_dim
    k = shape.num_key_value_heads * shape.head_dim
    return ((16 + 2 * compute) * shape.hidden_size + (8 + 2 * compute) * (q + k) + 4 * compute
            * shape.intermediate_size + 16 * shape.head_dim + 4 * shape.num_attention_heads + 64)


def block_forward_bytes(shape: ModelShape, compute: int) -> int:
    """Bytes per token of a block's no-grad forward at its peak (the logprob recompute): its attention half (q, k,
    v, RoPE's float32 copies, the output) or its feed-forward half (three intermediates at once), whichever is
    larger, plus the residual stream."""
    q = shape.num_attention_heads * shape.head_dim
    k = shape.num_key_value_heads * shape.head_dim
    attention = (8 + 2 * compute) * (q + k) + 2 * compute * q
    feed_forward = 3 * compute * shape.intermediate_size
    return max(attention, feed_forward) + 4 * compute * shape.hidden_size


def micro_batch_tokens(cfg: JobConfig, *, rows: int, recompute: bool = False) -> int:
    """Most tokens one micro-batch can hold (trainer/micro_batches.py's plan): rows of up to generator.max_model_len
    tokens, at most trainer.micro_batch_size of them and the token budget (one row alone may exceed it)."""
    t = cfg.trainer
    budget = (t.recompute_micro_batch_tokens or t.micro_batch_tokens) if recompute else t.micro_batch_tokens
    longest = cfg.generator.max_model_len
    most = min(t.micro_batch_size, rows) * longest
    return min(most, max(budget, longest)) if budget else most


def activation_bytes(cfg: JobConfig, shape: ModelShape, *, rows: int, recompute: bool, grads: int = 0) -> int:
    """Peak bytes beyond the trainer's weights and AdamW state of the largest micro-batch of ``rows`` rows: the
    train step's forward + backward, or (``recompute``) the logprob recompute's no-grad forward.

    The train step peaks either as a backward starts (every block's saved activations, or with
    activation_checkpoint full each block's input; the final hidden states; one logprob chunk's logits, all of
    them with logprob_chunk_tokens 0, and the lm_head's float32 gradient; this rank's ``grads`` when earlier
    micro-batches wrote them) or late in a backward (the gradients nearly all written, one block recomputed and its
    backward's transient). The recompute peaks in a block's attention or feed-forward half, or in a logprob chunk.
    Both hold the unsharded embedding and lm_head.
    """
    t = cfg.trainer
    compute = _BYTES[cfg.model.dtype]
    tokens = micro_batch_tokens(cfg, rows=rows, recompute=recompute)
    d, vocab, layers = shape.hidden_size, shape.vocab_size, shape.num_hidden_layers
    # Batch-invariant mode and tensor parallelism keep whole logits (trainer/build.py).
    chunk = t.logprob_chunk_tokens if (t.logprob_chunk_tokens and not cfg.batch_invariant_mode
                                       and t.parallelism.tensor_parallel_degree == 1) else 0
    logits_tokens = min(chunk, tokens) if chunk else tokens
    head = vocab * d * compute * (1 if shape.tie_word_embeddings else 2)  # unsharded embedding (and lm_head)
    hidden = tokens * d * compute * 2  # the final hidden states and the scored positions' copy
    if recompute:
        logits = logits_tokens * vocab * (compute + 12)  # logits, a float32 copy, / T, log-softmax
        return head + max(tokens * block_forward_bytes(shape, compute), hidden + logits)
    block = block_saved_bytes(shape, compute)
    full = t.activation_checkpoint == "full"
    inputs = tokens * layers * compute * d if full else 0  # what activation checkpointing keeps of each block
    logits = logits_tokens * vocab * LOGITS_BYTES[t.compile and not cfg.batch_invariant_mode]
    head_grad = vocab * d * 4 if chunk else 0  # trainer/logprobs.py accumulates the lm_head gradient in float32
    # Past the first of several micro-batches the gradients accumulated so far are there as the next forward runs.
    accumulated = grads if tokens < rows * cfg.generator.max_model_len else 0
    early = (inputs if full else tokens * layers * block) + hidden + logits + head_grad + accumulated
    late = grads + inputs + int(BACKWARD_PEAK * block * tokens)
    return head + max(early, late)


def engine_activation_bytes(cfg: JobConfig, shape: ModelShape) -> int:
    """What the engine's profile run peaks at beyond its weights (CUDA): a forward of PROFILE_TOKENS tokens or the
    sampler over one row of logits a sequence, whichever is larger; inside its gpu_memory_utilization share."""
    rows = min(cfg.generator.max_num_seqs, PROFILE_TOKENS)
    return max(PROFILE_TOKENS * block_forward_bytes(shape, _BYTES[cfg.model.dtype]),
               rows * shape.vocab_size * SAMPLER_BYTES)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM 0.26's default CUDA-graph batch sizes: 1, 2, 4, then steps of 8 to 256 and of 16 beyond, up to
    min(2 x max_num_seqs, 512)."""
    most = min(2 * max_num_seqs, 512)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, most + 1, 16)]
    return [s for s in sizes if s <= most]


def graph_bytes(cfg: JobConfig, shape: ModelShape) -> int:
    """What the engine's CUDA graphs hold (generator.enforce_eager false): one pool shared by every captured size,
    sized by the largest's forward, plus each graph's own; the compiled decoder captures piecewise graphs for
    prefills besides the full ones for decodes. Inside vLLM's gpu_memory_utilization while it runs; kept on the
    device while it sleeps (sleep frees only the tagged weights and KV cache)."""
    g = cfg.generator
    if g.enforce_eager:
        return 0
    sizes = capture_sizes(g.max_num_seqs)
    compute = _BYTES[cfg.model.dtype]
    modes = 2 if g.compile else 1
    return modes * len(sizes) * GRAPH_BYTES + max(sizes) * block_forward_bytes(shape, compute)


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
    trainer_activations: int
    """The train step's peak beyond the weights, AdamW state and gathered blocks: its largest micro-batch's forward
    + backward, the gradients it writes included (``activation_bytes``)."""
    train_tokens: int
    """Tokens of that micro-batch."""
    trainer_build: int
    """The trainer's build, before FSDP keeps this rank's shard: the whole model in the master dtype plus one float32
    block (trainer/build.py; 0 where each rank reads only its shard of HF weights)."""
    trainer_recompute: int
    """The logprob recompute's peak (a no-grad forward of its largest micro-batch), while the engine is awake."""
    recompute_tokens: int
    engine_weights: int
    engine_budget: int
    """What the engine takes on its device: its weights plus KV cache (on CUDA generator.gpu_memory_utilization of
    the device, all of it vLLM's to hold, its CUDA graphs included)."""
    engine_graphs: int
    """The engine's CUDA graphs (``graph_bytes``): what it keeps on the device asleep."""
    engine_activations: int
    """The engine's profile run's peak (``engine_activation_bytes``; 0 on CPU, whose engine is given its KV bytes)."""
    engine_while_training: int
    """What the engine keeps on the device while the trainer steps (its CUDA graphs asleep)."""
    grads_freed: bool
    """The gradients are freed after each step (generator.sleep), not kept through the next generation."""
    device_total: int
    role: str
    """colocated (trainer and engine on each GPU: weight_sync.transport inplace), trainer (its engine on another
    rank, nccl, or in a rollout server, server) or generator (nccl)."""
    kv_token_bytes: int
    """KV-cache bytes of one token (layers x 2 x KV heads x head_dim x the compute dtype's bytes, 1 in fp8)."""
    max_model_len: int
    max_num_seqs: int

    @property
    def kv_bytes(self) -> int:
        """The engine's budget beyond its weights, CUDA graphs and profiled activations: the KV cache a colocated
        engine is given (rollout/colocated.py), so that the engine holds what this estimate counts."""
        return max(0, self.engine_budget - self.engine_weights - self.engine_graphs - self.engine_activations)

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV cache holds (vLLM rounds down to whole blocks; the engine's count is printed once built)."""
        return self.kv_bytes // self.kv_token_bytes

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
    def _between_steps(self) -> int:
        """The trainer's resident bytes while the engine generates (the gradients freed when it sleeps)."""
        if self.role == "generator":
            return 0
        return self.trainer_resident - (self.trainer_grads if self.grads_freed and not self.offload else 0)

    @property
    def generate_peak(self) -> int:
        return self._between_steps + (self.engine_budget if self.role != "trainer" else 0)

    @property
    def score_peak(self) -> int:
        """The logprob recompute, after generation and before the engine sleeps."""
        if self.role == "generator":
            return 0
        return self.generate_peak + self.trainer_gathered + self.trainer_recompute

    @property
    def train_peak(self) -> int:
        if self.role == "generator":
            return 0
        engine = self.engine_while_training if self.role == "colocated" else 0
        # The step's first optimizer step zeroes the gradients (set to None) before its forward: they are counted
        # in the activations, as the backward writes them.
        state = self.trainer_resident - (0 if self.offload else self.trainer_grads)
        return state + self.trainer_gathered + self.trainer_activations + engine

    @property
    def peak(self) -> int:
        return max(self.generate_peak, self.score_peak, self.train_peak, self.trainer_build)

    def summary(self) -> str:
        """One line for the start of a run."""
        g = lambda n: f"{n / GIB:.1f}"  # noqa: E731
        where = "host" if self.offload else "device"
        parts = [f"memory per {'GPU' if self.device_total else 'rank'} (estimate):"]
        if self.role != "generator":
            parts.append(
                f"trainer {self.params / 1e9:.2f}B params / {self.shards} ranks in {self.master_dtype}: weights "
                f"{g(self.trainer_params)} + grads {g(self.trainer_grads)} + AdamW {g(self.trainer_adam)} + "
                f"reference {g(self.trainer_reference)} GiB on {where}, gathered blocks {g(self.trainer_gathered)}, "
                f"activations {g(self.trainer_activations)} (micro-batch of {self.train_tokens} tokens; recompute "
                f"{g(self.trainer_recompute)}, {self.recompute_tokens} tokens), build {g(self.trainer_build)};")
        if self.role != "trainer":
            parts.append(f"engine {g(self.engine_budget)} GiB (weights {g(self.engine_weights)} + CUDA graphs "
                         f"{g(self.engine_graphs)} + activations {g(self.engine_activations)} + KV cache "
                         f"{g(self.kv_bytes)}: {self.kv_tokens} tokens, "
                         f"{self.kv_tokens // self.max_model_len} sequences of max_model_len {self.max_model_len} "
                         f"beside max_num_seqs {self.max_num_seqs}), {g(self.engine_while_training)} while "
                         "the trainer steps;")
        parts.append(f"peak {g(self.peak)} GiB (generate {g(self.generate_peak)}, recompute {g(self.score_peak)}, "
                     f"train {g(self.train_peak)})")
        if self.device_total:
            parts.append(f"of {g(self.device_total)}, {g(self.device_total - self.peak)} left")
        return " ".join(parts)


def trainer_ranks(cfg: JobConfig, world_size: int) -> int:
    """Processes of the run that train (the nccl layout's last ranks generate)."""
    return world_size - (cfg.generator.parallelism.data_parallel_replicate_degree
                         if cfg.weight_sync.transport == "nccl" else 0)


def build_bytes(shape: ModelShape, *, params: int, block: int, master: int) -> int:
    """trainer/build.py's peak: the decoder blocks in ``master`` bytes (block_dtype) and one of them in float32 (its
    init), the embeddings, final norm and output layer in float32 (cast after the blocks)."""
    blocks = shape.num_hidden_layers * block
    return blocks * master + (params - blocks + block) * _BYTES["float32"]


def estimate(cfg: JobConfig, shape: ModelShape, *, world_size: int, device_total: int, role: str) -> MemoryEstimate:
    """The estimate for one rank of ``role`` in a run of ``world_size`` processes (a validated config)."""
    params, trainable, block = count_parameters(shape, cfg.model.lora)
    trainer_world = trainer_ranks(cfg, world_size)
    par = cfg.trainer.parallelism
    shards = max(1, trainer_world // par.data_parallel_replicate_degree)  # FSDP x TP ranks split each tensor
    rows = cfg.grpo.prompts_per_step * cfg.grpo.group_size // max(1, trainer_world // par.tensor_parallel_degree)
    master = _BYTES[cfg.trainer.master_dtype]
    compute = _BYTES[cfg.model.dtype]
    engine_weights = params * compute
    on_cuda = device_total > 0
    engine_budget = (int(cfg.generator.gpu_memory_utilization * device_total) if on_cuda
                     else engine_weights + int(cfg.generator.kv_cache_memory_gb * GIB))
    graphs = graph_bytes(cfg, shape) if on_cuda else 0
    asleep = SLEEP_LEVELS[cfg.generator.sleep] > 0
    step_rows = max(1, rows // cfg.grpo.mini_batches)
    offload = cfg.trainer.cpu_offload and on_cuda
    grads = -(-trainable * master // shards)
    return MemoryEstimate(
        params=params, trainable=trainable, shards=shards, master_dtype=cfg.trainer.master_dtype, offload=offload,
        trainer_params=-(-params * master // shards), trainer_grads=grads,
        trainer_adam=-(-2 * trainable * master // shards), trainer_gathered=2 * block * compute,
        trainer_reference=-(-params * master // shards) if cfg.grpo.kl_coef > 0 else 0,
        trainer_activations=activation_bytes(cfg, shape, rows=step_rows, recompute=False,
                                             grads=0 if offload else grads),
        train_tokens=micro_batch_tokens(cfg, rows=step_rows),
        trainer_build=0 if role == "generator" or reads_hf_shards(
            cfg.model, shape=shape, batch_invariant=cfg.batch_invariant_mode) else build_bytes(
            shape, params=params, block=block,
            master=block_dtype(cfg.trainer.master_dtype, cfg.model, batch_invariant=cfg.batch_invariant_mode).itemsize),
        trainer_recompute=activation_bytes(cfg, shape, rows=rows, recompute=True),
        recompute_tokens=micro_batch_tokens(cfg, rows=rows, recompute=True),
        engine_weights=engine_weights, engine_budget=max(engine_budget, engine_weights), engine_graphs=graphs,
        engine_activations=engine_activation_bytes(cfg, shape) if on_cuda else 0,
        engine_while_training=graphs if asleep else max(engine_budget, engine_weights), grads_freed=asleep,
        device_total=device_total, role=role, max_model_len=cfg.generator.max_model_len,
        kv_token_bytes=shape.num_hidden_layers * 2 * shape.num_key_value_heads * shape.head_dim
        * (1 if cfg.generator.kv_cache_dtype == "fp8" else compute),
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
    host memory), or when a CUDA engine's share leaves no room for one sequence of KV cache."""
    if est.device_total and est.role != "trainer" and est.kv_tokens < est.max_model_len:
        raise ValueError(
            f"generator.gpu_memory_utilization: its {est.engine_budget / GIB:.1f} GiB of {device} leave the engine "
            f"{est.kv_tokens} tokens of KV cache after its weights, CUDA graphs and activations, fewer than one "
            f"sequence of generator.max_model_len {est.max_model_len}; raise it ({est.summary()})")
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
        # torch's account (the card's free bytes, this process's, PyTorch's allocated and reserved) tells a full card
        # from a cap or fragmentation; its advice that follows is dropped.
        said = " ".join(str(e).split()).split(" If reserved but unallocated")[0] or "out of memory"
        raise ValueError(f"memory: CUDA ran out of memory at {where} ({said[:400]}); make room with {LEVERS}") \
            from None
    except RuntimeError as e:
        if "can't allocate memory" not in str(e):  # torch's CPU allocator: a RuntimeError, not OutOfMemoryError
            raise
        raise ValueError(f"memory: the host ran out of memory at {where} ({str(e).splitlines()[0][-120:]}); make "
                         f"room with {CPU_LEVERS}") from None
