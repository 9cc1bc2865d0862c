"""The one typed config tree of a run.

Every field carries a one-line docstring: tyro shows it in ``--help``.
Sections are plain dataclasses so that importing this module stays cheap
(no torch, no vLLM): ``--help`` and config validation run in a second.
Each section checks its own fields (``check(path)``); checks that need two
sections or the world size are in validation.py.

Long: the whole tree is in one file on purpose, one place to read every field and its docstring;
the checks (checks.py, validation.py), TOML (toml_io.py) and the CLI (cli.py) are beside it.
"""

import ipaddress
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Literal

from torchtitan_rl.config.checks import at_least, in_range, positive, positive_float


@dataclass(kw_only=True)
class JobSection:
    name: str = "grpo"
    """Run name: the progress bar's label and the W&B run name (the output folder is job.output_dir)."""
    output_dir: str = "outputs/grpo"
    """Folder of this config's runs: each run writes its config, metrics, plots and checkpoints to a new run-N
    sub-folder, and `latest` points at the newest (resume and export follow it)."""
    seed: int = 0
    """Seed for model init, prompt sampling and generation."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device for trainer and generator; auto picks cuda when available."""
    export: bool = False
    """After the last step, write the policy as a Hugging Face folder to <run folder>/hf (torchtitan_rl/export.py)."""
    export_dir: str | None = None
    """After the last step, write the policy here as a Hugging Face folder (torchtitan_rl/export.py); must not exist or be empty."""
    fit: Literal["auto", "off"] = "auto"
    """auto: on a GPU, when the memory estimate (printed at start) exceeds 95% of the device, change, in this order, generator.sleep (weights), trainer.master_dtype (bfloat16), trainer.micro_batch_tokens and recompute_micro_batch_tokens (halved) and trainer.cpu_offload until it fits, and say so in one line (run/fit.py); a run that fits as written is unchanged. off: run the config as written (a run that cannot fit is still refused)."""
    host_threads: int = 0
    """CPU threads of each process (torch intra-op, OpenMP, vLLM's, inductor's compile workers): 0: the cores this process may use divided by the processes sharing them (torchrun's local ranks, or on a GPU the host's GPUs), or OMP_NUM_THREADS when set (torchrun's 1 only under plain torchrun, not torchtitan_rl.launch); N: N; -1: leave torch's and vLLM's own defaults."""

    def check(self, path: str) -> None:
        at_least(self, path, -1, "host_threads")


@dataclass(kw_only=True)
class LoRAConfig:
    rank: int = 0
    """Adapter rank; 0 disables LoRA (full fine-tuning)."""
    alpha: float = 16.0
    """Adapter scale numerator: the adapter's output is multiplied by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training."""
    target_modules: tuple[str, ...] = ("wqkv", "wo", "w1", "w2", "w3")
    """Linear layers (module names in torchtitan's Qwen3) that get an adapter."""
    sync: Literal["adapter", "merged"] = "adapter"
    """adapter: base once, then only the adapter (unmerged in the generator); merged: W + BA in full."""

    def check(self, path: str) -> None:
        at_least(self, path, 0, "rank")
        in_range(self, path, "dropout", 0, 1, "[0, 1)")
        if self.rank and self.alpha <= 0:
            raise ValueError(f"{path}.alpha: must be > 0, got {self.alpha}")
        known = {"wqkv", "wo", "w1", "w2", "w3"}
        unknown = [m for m in self.target_modules if m not in known]
        if unknown or (self.rank and not self.target_modules):
            raise ValueError(f"{path}.target_modules: unknown {unknown or 'empty'}; choose from {sorted(known)}")


@dataclass(kw_only=True)
class ModelConfig:
    flavor: str = "tiny"
    """Shape for random init: Qwen3 tiny (CPU tests), debugmodel, 0.6B, 1.7B, 4B, 8B; Llama tiny-llama, smollm2-135m."""
    hf_checkpoint: str | None = None
    """Local Hugging Face folder (Qwen3ForCausalLM or LlamaForCausalLM); its config sets the shape. None: seeded random init."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Compute dtype of the generator and of the trainer's forward/backward."""
    vocab_size: int = 0
    """Vocabulary size; 0 takes the flavor's (tiny, tiny-llama: the task tokenizer's)."""
    max_seq_len: int = 512
    """Longest prompt + completion in tokens; sizes the RoPE cache of small flavors."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters: train only these, the base stays frozen. On an MoE model they go on attention only (experts and routers have no linear of these names): experts and routers stay frozen."""
    moe_load_balance_coeff: float = 0.0
    """MoE models: torchtitan's load balancing (auxiliary-loss-free, arXiv 2408.15664: before each optimizer step every layer's routing bias moves by this much toward its under-used experts; torchtitan's default 1e-3). 0: off, the RL default: HF Qwen3MoeForCausalLM has no routing bias, so an export could not carry it, and the policy's routing changes only through its gradient."""

    def check(self, path: str) -> None:
        positive(self, path, "max_seq_len")
        at_least(self, path, 0, "vocab_size", "moe_load_balance_coeff")
        self.lora.check(f"{path}.lora")


@dataclass(kw_only=True)
class ParallelismConfig:
    """Shared by trainer and generator so both sides describe layouts alike."""

    data_parallel_shard_degree: int = -1
    """FSDP degree; -1 takes all ranks left after the other degrees."""
    data_parallel_replicate_degree: int = 1
    """Trainer: DDP (replicate) degree. Engine: replicas R, each a whole vLLM engine on its own rank and device (weight_sync.transport nccl: the last R torchrun ranks; each batch's prompts split over them in contiguous blocks, one broadcast per bucket feeds all)."""
    tensor_parallel_degree: int = 1
    """Tensor-parallel degree (generator: vLLM tensor_parallel_size; must be 1 for now, docs/scaling.md)."""
    expert_parallel_degree: int = 1
    """Trainer, MoE models: torchtitan's expert parallelism: each rank computes num_experts / this many experts
    (tokens move to their experts by all-to-all) and FSDP shards the experts over the remaining
    (data_parallel_shard_degree * tensor_parallel_degree / this) ranks. Must divide both and the expert count.
    Generator: must be 1 (each engine holds every expert)."""

    def check(self, path: str, *, world_size: int, exact: bool) -> None:
        """exact: shard * replicate * tp must equal world_size (trainer); else divide it."""
        shard, rep, tp = self.data_parallel_shard_degree, self.data_parallel_replicate_degree, self.tensor_parallel_degree
        if shard != -1 and shard < 1:
            raise ValueError(f"{path}.data_parallel_shard_degree: must be -1 (infer) or >= 1, got {shard}")
        at_least(self, path, 1, "data_parallel_replicate_degree", "tensor_parallel_degree", "expert_parallel_degree")
        if shard == -1 or not exact:
            used = rep * tp * max(shard, 1)
            if world_size % used:
                raise ValueError(f"{path}: degrees multiply to {used}, which does not divide world size {world_size}")
        elif shard * rep * tp != world_size:
            raise ValueError(
                f"{path}: data_parallel_shard_degree ({shard}) * data_parallel_replicate_degree "
                f"({rep}) * tensor_parallel_degree ({tp}) = {shard * rep * tp} != world size {world_size}"
            )
        ep = self.expert_parallel_degree
        if not exact and ep != 1:
            raise ValueError(f"{path}.expert_parallel_degree: each engine holds every expert, so it must be 1, got {ep}")
        # torchtitan carves the expert ranks out of the FSDP x TP ones (the rest shard the experts, "efsdp").
        ranks = (world_size // (rep * tp) if shard == -1 else shard) * tp
        if exact and ranks % ep:
            raise ValueError(f"{path}.expert_parallel_degree: {ep} does not divide data_parallel_shard_degree x "
                             f"tensor_parallel_degree = {ranks}")


@dataclass(kw_only=True)
class OptimizerConfig:
    name: Literal["AdamW"] = "AdamW"
    """Optimizer; AdamW on fp32 master weights."""
    lr: float = 3e-3
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""

    def check(self, path: str) -> None:
        at_least(self, path, 0, "lr", "weight_decay", "eps")
        for i, beta in enumerate(self.betas):
            if not 0 <= beta < 1:
                raise ValueError(f"{path}.betas[{i}]: must be in [0, 1), got {beta}")


@dataclass(kw_only=True)
class LRSchedulerConfig:
    warmup_steps: int = 0
    """Linear warmup steps from 0 to the peak learning rate."""
    decay: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the schedule after warmup."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of the peak (linear and cosine)."""

    def check(self, path: str) -> None:
        at_least(self, path, 0, "warmup_steps")
        in_range(self, path, "min_lr_ratio", 0, 1, "[0, 1]")


@dataclass(kw_only=True)
class CheckpointConfig:
    enable: bool = False
    """Write checkpoints (torch.distributed.checkpoint) during training."""
    interval: int = 50
    """Steps between checkpoints."""
    folder: str = "checkpoints"
    """Sub-folder of the run folder (job.output_dir/run-N) holding step-N checkpoints."""
    keep_latest: int = 2
    """How many complete checkpoints to keep; 0 keeps all."""

    def check(self, path: str) -> None:
        positive(self, path, "interval")
        at_least(self, path, 0, "keep_latest")
        if PurePath(self.folder).is_absolute() or ".." in PurePath(self.folder).parts:
            raise ValueError(f"{path}.folder: must be a sub-folder of the run folder, got {self.folder}")


@dataclass(kw_only=True)
class TrainerConfig:
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """How the trainer's model is sharded over its ranks."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer settings."""
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    """Learning-rate schedule."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    steps: int = 40
    """Number of GRPO steps (one sync and rollout each, then grpo.epochs x grpo.mini_batches optimizer steps)."""
    micro_batch_size: int = 64
    """Most sequences per forward/backward on one rank; gradients accumulate over them."""
    micro_batch_tokens: int = 0
    """Token budget of a micro-batch (rows x its longest row, rows sorted by length); 0: micro_batch_size rows only."""
    recompute_micro_batch_tokens: int = 0
    """Token budget of the logprob recompute's micro-batches (no grad: no activations kept, so it can be far larger); 0: micro_batch_tokens."""
    logprob_chunk_tokens: int = 2048
    """Tokens whose [tokens, vocab] logits exist at once (lm_head + log-softmax in chunks); 0: whole micro-batch logits. Batch-invariant mode keeps whole logits."""
    compile: bool = False
    """torch.compile each decoder block and the chunked log-softmax; ignored in batch_invariant_mode (its own kernels)."""
    activation_checkpoint: Literal["none", "full"] = "none"
    """full: keep only each block's input and recompute the block in backward (memory for ~1/3 more compute)."""
    cpu_offload: bool = False
    """FSDP2's CPUOffloadPolicy (torchtitan's training.enable_cpu_offload): parameters, gradients and AdamW state live in host memory and the optimizer steps on the CPU; the device holds the blocks FSDP gathers. For a trainer state (16 bytes a parameter in float32) that does not fit beside the engine; weight_sync.transport inplace, on CUDA only (a CPU run's state is in host memory already)."""
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the trainer's parameters, gradients and AdamW state (torchtitan's training.dtype): float32 masters (16 bytes a parameter) or bfloat16 throughout (8; updates below bf16's resolution of a weight are lost)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    collective_timeout_s: float = 3600.0
    """Seconds a trainer collective may wait for the other trainer ranks, e.g. while a step's rollouts are generated and scored; then the run ends naming it."""

    def check(self, path: str) -> None:
        """The section's own fields; its parallelism needs the world size (config.validation)."""
        positive(self, path, "steps", "micro_batch_size")
        at_least(self, path, 0, "max_grad_norm", "micro_batch_tokens", "recompute_micro_batch_tokens",
                 "logprob_chunk_tokens")
        positive_float(self, path, "collective_timeout_s")
        self.checkpoint.check(f"{path}.checkpoint")
        self.optimizer.check(f"{path}.optimizer")
        self.lr_scheduler.check(f"{path}.lr_scheduler")


@dataclass(kw_only=True)
class SamplingConfig:
    temperature: float = 1.0
    """Sampling temperature, in (0, 2]: the trainer scores logits / temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass. Below 1 the generator's logprobs are the truncated distribution's: no grpo.importance_correction, no mismatch metric."""
    top_k: int = -1
    """Top-k cut-off; -1 disables it (>= 1: as top_p < 1)."""
    max_tokens: int = 8
    """Completion length limit in tokens."""

    def check(self, path: str) -> None:
        positive(self, path, "max_tokens")
        # vLLM's range is [0, 2], but 0 (greedy) has no distribution the trainer could score: logits / 0.
        in_range(self, path, "temperature", 0, 2, "(0, 2]")
        in_range(self, path, "top_p", 0, 1, "(0, 1]")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"{path}.top_k: must be -1 (off) or >= 1, got {self.top_k}")


@dataclass(kw_only=True)
class GeneratorConfig:
    parallelism: ParallelismConfig = field(
        default_factory=lambda: ParallelismConfig(data_parallel_shard_degree=1)
    )
    """How the generator is laid out (data_parallel_replicate_degree: replicas; tensor_parallel_degree -> vLLM TP)."""
    gpu_memory_utilization: float = 0.3
    """Fraction of GPU memory vLLM may take (weights + KV cache)."""
    kv_cache_memory_gb: float = 0.25
    """KV-cache size on CPU in GiB (vLLM's CPU backend needs it explicit)."""
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """auto: the KV cache in the model's dtype; fp8: in float8 (vLLM's kv_cache_dtype, scales of 1): half the bytes, so twice the tokens in the same memory and half the KV reads of a long-context decode step (the long tail's bound, docs/benchmarks.md), at the cost of a larger gap between the generator's logprobs and the trainer's (grpo.importance_correction sees it). Not in batch_invariant_mode. vLLM's CPU backend needs AVX-512 or AMX and head_dim a multiple of 32."""
    attention_backend: Literal["auto", "FLASH_ATTN", "TRITON_ATTN"] = "auto"
    """A GPU engine's attention kernels (vLLM's attention_backend): auto: vLLM's pick (FLASH_ATTN on Hopper, FA3);
    TRITON_ATTN: vLLM's Triton kernels, which read an fp8 KV cache their own way (FA3 reads one at about half the
    H200's bandwidth, docs/benchmarks.md "The long tail"). batch_invariant_mode reads the cache in FLASH_ATTN's
    layout; vLLM's CPU backend has its own kernels (auto only)."""
    seeded_noise: Literal["vllm", "batched"] = "vllm"
    """How an engine on vLLM's V1 GPU model runner draws each sample's seeded noise every decode step (every sample is its own seeded request): vllm: vLLM's sampler, a kernel per sample (512 a step at the mission's batch); batched: one kernel for all, each row from its seed and draw count (kernels/seeded_noise.py): a seed gives the same samples in any layout, but other samples than with vllm. Process-wide. vLLM 0.26 runs a dense model on its model runner V2, which draws every request's noise in one kernel already, and CPU engines sample as vLLM's CPU backend does: there batched changes nothing (the run says so)."""
    loop_threads: int = 0
    """torch's intra-op threads while a GPU engine's loop runs (a generate), restored after; 0: keep job.host_threads's
    count. 1 is vLLM >= 0.32's serving rule (an OpenMP team spin-waiting after each small CPU op of the loop), but
    under vLLM 0.26 on one H100 it made the mission's generate slower, not faster (docs/benchmarks.md). CPU engines
    compute with the process's threads either way."""
    max_model_len: int = 64
    """Longest prompt + completion vLLM accepts."""
    max_num_seqs: int = 256
    """Most sequences vLLM schedules at once."""
    enforce_eager: bool = True
    """Run eagerly; false lets vLLM capture CUDA graphs on GPU."""
    compile: bool = False
    """vLLM torch.compiles the generator's model (its VLLM_COMPILE mode: inductor fuses RMSNorm, QK-norm, RoPE, SiLU-mul; piecewise CUDA graphs for prefills, full ones for decodes); needs enforce_eager false; ignored in batch_invariant_mode and with unmerged LoRA adapters. The sync still writes the tensors the compiled graphs read."""
    compile_cache_dir: str = "~/.cache/torchtitan_rl"
    """With generator.compile: where the compiled decoder is kept for the next run (vLLM's compile cache, VLLM_CACHE_ROOT unless set, under vllm/; the engine's model config.json at a path per model shape under models/, which vLLM's cache key includes); empty: vLLM's default cache and a config.json in the run folder, so each run compiles again."""
    async_scheduling: bool = True
    """vLLM schedules iteration i+1 while the device runs iteration i (vLLM 0.26's own default for this engine on GPU; vLLM's CPU backend turns it off, we keep it on when asked so CPU runs take the same path). Samples are the same with it on or off (seeded); every generate ends with no iteration in flight."""
    load_format: Literal["dummy", "auto"] = "dummy"
    """dummy: random start, serve only after the first sync; auto: load model.hf_checkpoint."""
    wait_for_weights_s: float = 0.0
    """How long a generate call waits for the first sync; 0 raises at once."""
    sleep: Literal["off", "kv_cache", "weights"] = "off"
    """weight_sync.transport inplace, CUDA: free the engine's device memory while the trainer steps (vLLM sleep mode); the next sync wakes it. kv_cache: level 1 (KV cache dropped, weights parked in host memory); weights: level 2 (both dropped: the next sync rewrites and verifies every tensor, nothing is served before). vLLM has no sleep mode on CPU."""
    inflight_updates: bool = False
    """weight_sync.transport nccl: a sync lands between two engine iterations of the generate in progress (PipelineRL's in-flight weight updates): running samples are not stopped, the next iteration computes with the new weights, and each token records the version it was sampled with; requests made after a sync never reuse KV blocks computed under older weights (vLLM's cache_salt, set to the version). With generator.async_scheduling (vLLM schedules the next iteration while one runs) a waiting sync first stops the scheduling and lets the iteration in flight finish, then lands, then scheduling resumes: one iteration's overlap lost per sync."""
    stream_groups: bool = False
    """weight_sync.transport nccl: each replica posts a group as soon as its samples finish, and the trainer recomputes pi_old of the finished groups (one group at a time, split over its ranks) while the rest are still generated, instead of all of them after the slowest. Single-turn tasks."""
    overlap_training: bool = False
    """weight_sync.transport inplace with grpo.max_staleness >= 1: each trainer rank's engine generates the requests made ahead in a thread of its own (on a CUDA stream of its own) while the trainer builds and trains the step before, as a generator on its own rank does, but on the trainer's GPUs; a sync first waits for the requests in flight. Off: generate, then train (the requests made ahead wait for their step). The engine's KV cache and the trainer's memory are held at once (generator.sleep off). On one H200 at 0.6B the decode slowed by about as much as the training it hid (docs/benchmarks.md, "The long tail")."""
    colocated_ranks: Literal["all", "first"] = "all"
    """weight_sync.transport inplace under torchrun: all: every trainer rank holds an engine on its device and generates a block of each batch; first: rank 0 alone generates (less memory on the others, their devices idle meanwhile)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling settings for rollouts."""

    def check(self, path: str) -> None:
        """The section's own fields; its parallelism needs the world size (config.validation)."""
        positive(self, path, "max_model_len", "max_num_seqs")
        at_least(self, path, 0, "wait_for_weights_s", "loop_threads")
        in_range(self, path, "gpu_memory_utilization", 0, 1, "(0, 1]")
        positive_float(self, path, "kv_cache_memory_gb")
        if self.compile and self.enforce_eager:
            raise ValueError(f"{path}.compile: needs {path}.enforce_eager false (vLLM compiles nothing in eager mode)")
        self.sampling.check(f"{path}.sampling")


@dataclass(kw_only=True)
class HarnessLengthsConfig:
    """Response lengths of the timing harness: seeded random weights (grpo.task_without_checkpoint, no
    model.hf_checkpoint) almost never emit eos, so the harness sets each sample's length itself."""

    distribution: Literal["fixed", "lognormal"] = "fixed"
    """fixed: every sample runs to generator.sampling.max_tokens; lognormal: each sample's length is drawn from a log-normal with this median and p90, capped at generator.sampling.max_tokens, seeded by the request, the prompt's index and the sample's (the same samples in every layout), and the sample runs to exactly that length, eos ignored (engine/lengths.py; the default's sources: docs/design.md, "The long tail"). Ignored with model.hf_checkpoint: real weights stop where they stop."""
    median: int = 1500
    """lognormal: median response length in tokens."""
    p90: int = 5000
    """lognormal: 90th-percentile response length in tokens (> median); sets the spread."""

    def check(self, path: str) -> None:
        positive(self, path, "median", "p90")
        if self.distribution == "lognormal" and self.p90 <= self.median:
            raise ValueError(f"{path}.p90: must exceed {path}.median ({self.median}), got {self.p90}")


@dataclass(kw_only=True)
class PartialRolloutConfig:
    """Partial rollouts (docs/design.md, "Partial rollouts and in-flight updates"): a generate stops before its
    slowest samples, which continue in a later step's generate under newer weights."""

    enable: bool = False
    """A generate stops once grpo.prompts_per_step of its groups are finished; the unfinished samples are kept (tokens and generator logprobs so far) and continue in the next generate, resubmitted as prompt + completion so far under the weights of then; every token records the weight version it was sampled with. Single-turn tasks; not with dynamic sampling or the rollout server."""
    over_sample: int = 0
    """Groups in flight beyond grpo.prompts_per_step (slime's over-sampling): each generate holds the carried groups plus new ones up to prompts_per_step + over_sample, and stops when prompts_per_step are finished (the oldest finished ones train)."""
    token_budget: int = 0
    """Generated tokens a generate spends before it stops, but never before the step's groups are finished; 0: stop as soon as they are."""
    max_token_age: int = 1
    """Most weight versions a trained token may be behind the step that trains it (AReaL's max_head_offpolicyness); a carried group that a later step would train past it is run to its end in this step's generate instead of being cut again. At least 2 x grpo.max_staleness + 1: the age of a carried token at its earliest next step."""

    def check(self, path: str) -> None:
        at_least(self, path, 0, "over_sample", "token_budget")
        positive(self, path, "max_token_age")


@dataclass(kw_only=True)
class GRPOConfig:
    task: str = "digits"
    """Task: digits[:mode] (own 16-token tokenizer), math, calculator (multi-turn, a tool), dataset, or 'package.module:factory' (README)."""
    task_without_checkpoint: str | None = None
    """Task run instead of grpo.task when model.hf_checkpoint is unset: random weights, a timing harness that learns nothing (e.g. digits, whose ids fit any vocabulary)."""
    harness_lengths: HarnessLengthsConfig = field(default_factory=HarnessLengthsConfig)
    """The timing harness's response lengths (grpo.task_without_checkpoint without model.hf_checkpoint): fixed, or drawn from a long-tailed distribution like a reasoning run's."""
    prompts_per_step: int = 16
    """Distinct prompts per step (global)."""
    group_size: int = 8
    """Completions sampled per prompt (G)."""
    clip_eps_low: float = 0.2
    """Lower PPO-style ratio clip: ratio >= 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """Upper ratio clip: ratio <= 1 + clip_eps_high."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the initial policy (GRPO as published: 0.04); 0 disables it. > 0 builds a second, frozen trainer model from the same weights: one more fp32 copy of the parameters (4 bytes each, sharded as the trainer's; no optimizer state) and one more forward per step."""
    advantage_norm: Literal["group_std", "none"] = "group_std"
    """group_std: (r - mean) / std per group; none: r - mean only."""
    max_staleness: int = 0
    """Steps the generator may run ahead: step k may train on rollouts sampled with the weights of step k - max_staleness, generated while the trainer learns (0: generate, then train, on the same weights)."""
    importance_correction: Literal["off", "truncate", "mask"] = "off"
    """Weight w on the policy loss for sampling with other weights or kernels than the trainer's, from rho = pi_old / pi_generator, per token (per sequence, its geometric mean, with grpo.ratio_level sequence): truncate: min(rho, cap) (TIS); mask: rho inside [1/cap, cap], else 0; off: 1 (docs/design.md)."""
    importance_cap: float = 2.0
    """The cap C of grpo.importance_correction (> 1)."""
    epochs: int = 1
    """Passes over each batch of rollouts (PPO epochs); > 1 reuses the batch, so the ratio pi / pi_old moves off 1 and clipping acts. One batch is still one weight version for the generator."""
    mini_batches: int = 1
    """Optimizer steps per pass: each rank's rows split into this many contiguous parts (whole groups where the split allows), so at most its rows (P x G / data-parallel ranks); pi_old stays the batch's start."""
    old_logprobs: Literal["recompute", "train"] = "recompute"
    """Where pi_old comes from. recompute: a forward of the batch before training (the trainer's weights at the batch's start). train: with one optimizer step per batch (grpo.epochs and grpo.mini_batches 1) those are the weights the training forward runs with, so pi_old is its own logprobs, detached (as TRL does for one iteration): a forward of the batch fewer (the mission step's ~0.4 s recompute on an H100), the ratio exactly 1, and the generator-vs-trainer mismatch metrics and grpo.importance_correction's weights taken from that forward. Needs a dense model (an MoE recompute records the routes) and no generator.stream_groups or batch_invariant_mode (their recomputes are what they overlap or prove)."""
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    """token_mean: sum over tokens / tokens (DAPO); seq_mean_token_mean: mean over sequences of each one's token mean (GRPO); seq_mean_token_sum_norm: sum over tokens / (rows x generator.sampling.max_tokens), a constant, overlong-masked rows included (Dr. GRPO)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """token: per-token ratio pi / pi_old (PPO, GRPO); sequence (GSPO): each sequence's geometric-mean ratio, clipped as one (its paper clips at 3e-4 / 4e-4), and grpo.importance_correction per sequence too; the advantage is per sequence either way, the loss still sums per-token terms."""
    dynamic_sampling: bool = False
    """Drop groups whose completions are all right or all wrong (DAPO's accuracy filter, Task.correct: a format bonus or length penalty does not count as signal, so a format the policy starts without is learned, if at all, only in groups kept for their accuracy (one of two DAPO seeds had not learned the boxed format by step 100): docs/benchmarks.md, "GRPO recipes on SmolLM2 math") and draw the prompts still missing until the batch holds grpo.prompts_per_step groups with signal."""
    dynamic_sampling_max_rounds: int = 3
    """Most extra draws per step under dynamic sampling (each of the groups still missing); still short after them, the batch is topped up with dropped groups."""
    overlong: Literal["off", "mask", "soft_penalty"] = "off"
    """Completions cut at generator.sampling.max_tokens: off: trained as any; mask: left out of the loss (DAPO's overlong filtering); soft_penalty: DAPO's length penalty over the last grpo.overlong_buffer tokens, added to the reward."""
    overlong_buffer: int = 64
    """soft_penalty: the last L tokens before max_tokens in which the penalty grows linearly from 0 to -grpo.overlong_penalty."""
    overlong_penalty: float = 1.0
    """soft_penalty: the penalty at max_tokens (DAPO: 1)."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus (the policy's token entropy, aggregated as the loss) subtracted from the loss; 0: entropy is only measured."""
    routing_replay: bool = False
    """MoE models: the trainer's recompute and loss route each token to the experts the generator chose for it (routing replay, "R3"; the gate weights still come from the trainer's router, so it learns); off: the trainer routes itself. Either way metrics.jsonl logs routing_mismatch, the fraction of tokens whose top-k experts differ between the two. Colocated generator only."""
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
    """Partial rollouts: stop a generate before its slowest samples and continue them later (off by default)."""

    def check(self, path: str) -> None:
        positive(self, path, "prompts_per_step", "epochs", "mini_batches")
        at_least(self, path, 2, "group_size")
        self.harness_lengths.check(f"{path}.harness_lengths")
        at_least(self, path, 0, "kl_coef", "max_staleness", "overlong_penalty", "entropy_coef")
        if not self.importance_cap > 1:  # mask keeps [1/cap, cap]: at 1 it would drop almost every token
            raise ValueError(f"{path}.importance_cap: must be > 1, got {self.importance_cap}")
        in_range(self, path, "clip_eps_low", 0, 1, "[0, 1)")
        in_range(self, path, "clip_eps_high", 0, 1, "[0, 1)")
        if self.dynamic_sampling:
            positive(self, path, "dynamic_sampling_max_rounds")
        if self.old_logprobs == "train":
            if self.epochs != 1 or self.mini_batches != 1:
                raise ValueError(f"{path}.old_logprobs: 'train' needs one optimizer step per batch ({path}.epochs and "
                                 f"{path}.mini_batches 1, got {self.epochs} and {self.mini_batches}): a later step "
                                 "would train against weights that are no longer pi_old")
        self.partial.check(f"{path}.partial")


@dataclass(kw_only=True)
class TaskConfig:
    """Settings of the math and dataset tasks (grpo.task); a user factory may take them too."""

    tokenizer: str | None = None
    """Folder with tokenizer.json and a chat template; none takes model.hf_checkpoint."""
    system_prompt: str = "You are a helpful assistant. Solve the problem step by step."
    """System message of every prompt; empty leaves it to the chat template's default."""
    instruction: str = "Put the final answer in \\boxed{}."
    """Appended to every question on a new line: the answer format the reward reads best."""
    format_reward_weight: float = 0.0
    """Reward added for a \\boxed{...} answer, right or wrong; 0 scores correctness only."""
    numeric_answer: Literal["number", "expression"] = "number"
    """math, calculator, dataset: what an answer to a numeric reference must be. number: a number as written (119,
    1,080, 119.0, 50%, \\frac{1}{2}), so '38 + 81 = 38 + 81' scores 0 for 119: on a task whose answer is a
    number, math-verify's symbolic equality would reward a policy that writes the sum and stops computing.
    expression: that symbolic equality (any expression equal to the reference). Non-numeric references
    (x^2 + 1) are compared symbolically either way."""
    levels: tuple[int, ...] = (1, 2, 3, 4, 5)
    """math: levels drawn uniformly, repeats weigh more (1: one + or -; 2: one * or /; 3, 4: two steps; 5: three)."""
    heldout_size: int = 500
    """math, calculator: problems in the fixed held-out set (never drawn for training)."""
    max_turns: int = 4
    """calculator: turns per episode (tool calls answered + 1)."""
    path: str | None = None
    """dataset: JSONL or Parquet file of problems (one object / row each)."""
    heldout_path: str | None = None
    """dataset: a second file of held-out problems; none splits heldout_fraction off task.path."""
    heldout_fraction: float = 0.1
    """dataset: share of task.path held out (by a hash of the prompt) when task.heldout_path is unset."""
    prompt_field: str = "question"
    """dataset: field (JSON key or Parquet column) holding the question."""
    answer_field: str = "answer"
    """dataset: field holding the answer; GSM8K's '... #### 42' gives 42."""

    def check(self, path: str) -> None:
        """The section's own fields; what grpo.task needs of it is checked in config.validation."""
        at_least(self, path, 0, "format_reward_weight")
        positive(self, path, "heldout_size", "max_turns")
        in_range(self, path, "heldout_fraction", 0, 1, "[0, 1)")
        bad = [level for level in self.levels if not 1 <= level <= 5]
        if bad or not self.levels:
            raise ValueError(f"{path}.levels: each must be in 1..5, got {list(self.levels)}")


@dataclass(kw_only=True)
class EvalSetConfig:
    """A named evaluation set: a file of (question, answer) records, rendered and scored as training's are."""

    name: str = ""
    """Name in the metrics (eval_accuracy/NAME) and in samples.jsonl: letters, digits, '_', '-', '.'."""
    path: str = ""
    """A .jsonl/.json or .parquet file, or a folder written by datasets' save_to_disk (one record per problem)."""
    split: str = ""
    """A save_to_disk folder of several splits (a DatasetDict): the one to read; empty when it holds one."""
    prompt_field: str = "question"
    """Field holding the question."""
    answer_field: str = "answer"
    """Field holding the reference answer; GSM8K's '... #### 42' gives 42."""
    verifier: Literal["math_verify", "exact"] = "math_verify"
    """math_verify: the final answer equals the reference symbolically (training's reward); exact: the completion, stripped, equals the answer."""
    numeric_answer: Literal["number", "expression"] = "number"
    """math_verify: what an answer to a numeric reference must be, as task.numeric_answer (number: a number as written,
    so '38 + 81' does not count for 119; expression: any expression equal to it). Default number, as training's."""
    system_prompt: str | None = None
    """System message of the set's prompts; none takes the run's task.system_prompt (the run's chat template either way)."""
    instruction: str | None = None
    """Appended to each question; none takes the run's task.instruction."""
    num_prompts: int = 0
    """Problems scored (the first N of the file); 0: all."""
    max_tokens: int = 0
    """Completion length limit; 0 takes eval.max_tokens, then generator.sampling.max_tokens."""
    mean_at_k: int = 0
    """Also sample k completions per problem at the training temperature and report their mean accuracy; 0: off."""

    def check(self, path: str) -> None:
        if not self.name or not all(c.isalnum() or c in "_-." for c in self.name) or self.name == "heldout":
            raise ValueError(f"{path}.name: must be non-empty letters, digits, '_', '-' or '.' (not 'heldout', the "
                             f"task's own set), got {self.name!r}")
        if not self.path:
            raise ValueError(f"{path}.path: set a .jsonl, .parquet file or a datasets folder")
        at_least(self, path, 0, "num_prompts", "max_tokens", "mean_at_k")


@dataclass(kw_only=True)
class EvalConfig:
    every_n_steps: int = 0
    """Greedy pass@1 on the task's held-out set and on eval.sets before the first step, every N steps and at the end; 0: never."""
    num_prompts: int = 0
    """Held-out problems per evaluation (the first N of the fixed set); 0 takes the whole set."""
    max_tokens: int = 0
    """Completion length limit during evaluation; 0 takes generator.sampling.max_tokens."""
    mean_at_k: int = 0
    """Also sample k completions per problem at the training temperature and report mean accuracy; 0: off."""
    sets: tuple[EvalSetConfig, ...] = ()
    """Named evaluation sets ([[eval.sets]] tables in TOML), each scored with the held-out set and logged as eval_accuracy/NAME with its standard error."""

    def check(self, path: str) -> None:
        at_least(self, path, 0, "every_n_steps", "num_prompts", "max_tokens", "mean_at_k")
        for i, s in enumerate(self.sets):
            s.check(f"{path}.sets[{i}]")
        names = [s.name for s in self.sets]
        if len(set(names)) != len(names):
            raise ValueError(f"{path}.sets: names must differ, got {names}")
        if self.sets and not self.every_n_steps:
            raise ValueError(f"{path}.every_n_steps: eval.sets are scored every N steps; set N > 0")


@dataclass(kw_only=True)
class WandbConfig:
    project: str | None = None
    """Weights & Biases project to log every metric to (pip install 'torchtitan_rl[wandb]'); none: off."""
    mode: Literal["offline", "online"] = "offline"
    """offline: write the run under output_dir/wandb, no network (upload later with `wandb sync`); online: stream it."""
    entity: str | None = None
    """W&B team or user; none takes the logged-in default."""


@dataclass(kw_only=True)
class MetricsConfig:
    samples_per_eval: int = 4
    """Completions of each held-out evaluation written to samples.jsonl and TensorBoard's text tab (prompt, completion, reward, version); 0: none."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases, beside metrics.jsonl and TensorBoard."""

    def check(self, path: str) -> None:
        at_least(self, path, 0, "samples_per_eval")


@dataclass(kw_only=True)
class WeightSyncConfig:
    enable: bool = True
    """Push trainer weights to the generator each step (false: negative control, one sync at the start only: step 0's weights, or a --resume checkpoint's)."""
    transport: Literal["inplace", "nccl", "server"] = "inplace"
    """inplace: generator in the trainer ranks' processes (generator.colocated_ranks: every rank, or rank 0 only); nccl: generator replicas on the last torchrun ranks (generator.parallelism.data_parallel_replicate_degree, default 1), own devices; server: a rollout server (python -m torchtitan_rl.serve) at serve.host:serve.port."""
    bucket_mb: int = 512
    """Largest bucket of gathered/cast tensors in flight, in MiB."""
    verify: Literal["off", "sampled", "full"] = "sampled"
    """After each sync compare generator tensors with the source: none, a few, all."""
    verify_samples: int = 4
    """Tensors compared per sync when verify is sampled."""
    peer_timeout_s: float = 1800.0
    """transport=nccl or server: seconds one side waits for the other (engine start, a step) before it gives up."""

    def check(self, path: str) -> None:
        positive(self, path, "verify_samples", "bucket_mb")
        positive_float(self, path, "peer_timeout_s")


SECRETS = {"serve.token": "TORCHTITAN_RL_SERVE_TOKEN", "serve.api_key": "TORCHTITAN_RL_API_KEY"}
"""Secret fields and the environment variables that may hold them; config.toml shows them as REDACTED."""
REDACTED = "<redacted>"


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


@dataclass(kw_only=True)
class ServeConfig:
    """The generator as an OpenAI-style HTTP server (python -m torchtitan_rl.serve); the trainer reaches it
    with weight_sync.transport = server."""

    host: str = "127.0.0.1"
    """Address the server binds and the trainer connects to; 0.0.0.0 exposes it (the trainer then uses 127.0.0.1)."""
    port: int = 8000
    """HTTP port: /v1/completions, /v1/chat/completions, /v1/models, /health, /control/*."""
    token: str = ""
    """Shared secret of the trainer and the server: the control endpoints' Bearer token and the key that signs
    every sync message; required. Or set TORCHTITAN_RL_SERVE_TOKEN (kept out of `ps`); config.toml redacts it."""
    api_key: str = ""
    """Bearer key the generation endpoints (/v1/*) require (vLLM's --api-key); empty: open to whoever reaches
    the port, allowed only on a loopback serve.host. Or set TORCHTITAN_RL_API_KEY; config.toml redacts it."""
    sync_timeout_s: float = 30.0
    """Server side: seconds one step of a sync (a header's buckets, a verdict) may take before the server drops
    the sync of a dead or stalled trainer and serves on; also how long a request queued behind a sync waits
    before its 503."""
    max_concurrent_requests: int = 1024
    """Generation requests in progress at once (queued for the engine or running, counted once their body is
    read: a slow upload holds no slot); one more gets 429 with Retry-After."""
    max_requests_per_client: int = 256
    """Generation requests one client address may have open at once, from their first byte (uploads
    included); one more gets 429 with Retry-After. Keeps one client's slow or many uploads from starving the
    others."""
    read_timeout_s: float = 30.0
    """Seconds a client may take to send a request's headers (then its connection is closed) and, once they
    are in, its body (then 408)."""
    model_name: str = "torchtitan_rl"
    """Model name listed at /v1/models; requests naming another model get 404."""
    max_body_mb: float = 16.0
    """Largest request body in MiB; a larger one gets 413."""
    max_n: int = 4096
    """Most completions one request may ask for (n times the number of prompts); a training step asks for
    grpo.prompts_per_step x grpo.group_size in one request."""
    sync_port: int = 0
    """Ignored: the server opens no store port since the sync store moved behind /control/store; kept so the
    config.toml of a run written before still loads (--resume)."""
    takeover: bool = False
    """Trainer side: replace the trainer connected to the server now (it is told so in one line at its next
    sync). Without it, a trainer that finds another connected waits until that one's session lease runs out
    (serve.session_lease_s: a crashed trainer's does, so a plain restart reconnects) and otherwise stops with a
    one-line error naming this field."""
    sync_store_mb: float = 64.0
    """Most MiB the trainer's sync messages (its tensor list, the plans, each sync's header) may hold in the
    server's memory; a write past it gets 413. The store is reached only through /control/store, with
    serve.token."""
    session_lease_s: float = 30.0
    """Server side: seconds a trainer's sync session lasts without a request from that trainer (its client
    renews it every fifth of this while it trains, generates or syncs). A session whose lease ran out (its
    trainer was killed or is frozen) is replaced by the next trainer that connects, without serve.takeover."""
    ssl_certfile: str = ""
    """Server side: PEM certificate (chain) to serve HTTPS with (uvicorn's ssl_certfile); with it the server
    speaks TLS only, and the trainer connects with https. Without it, a serve.host beyond loopback carries
    serve.token and serve.api_key in clear (the server says so at start)."""
    ssl_keyfile: str = ""
    """Server side: the PEM private key of serve.ssl_certfile (empty: the certificate file holds it)."""
    ssl_cafile: str = ""
    """Trainer side: PEM CA bundle, or the server's own self-signed certificate, to verify the server's
    certificate against; setting it (or serve.ssl_certfile) makes the trainer use https. Empty: the system's
    CAs. The certificate must name the address the trainer connects to (serve.host; 127.0.0.1 for 0.0.0.0)."""

    def in_clear_beyond_loopback(self) -> bool:
        """Whether serve.host is reachable from other machines while the server speaks plain HTTP."""
        return not _loopback(self.host) and not self.ssl_certfile

    def check(self, path: str) -> None:
        """Ports, secrets and limits (secrets already filled from the environment: config.validation.check_serve)."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"{path}.port: must be a TCP port in [0, 65535], got {self.port}")
        if self.port == 0:
            raise ValueError(f"{path}.port: must be set (the trainer and clients connect to it), got 0")
        if not self.token:
            raise ValueError(f"{path}.token: set a shared secret (or TORCHTITAN_RL_SERVE_TOKEN); the trainer's "
                             "control requests and sync messages must carry it")
        if not self.api_key and not _loopback(self.host):
            raise ValueError(f"{path}.api_key: required when serve.host ({self.host}) is reachable beyond this "
                             "machine; set it (or TORCHTITAN_RL_API_KEY), or bind 127.0.0.1")
        positive(self, path, "max_body_mb", "max_n", "sync_timeout_s", "max_concurrent_requests", "sync_store_mb",
                 "max_requests_per_client", "read_timeout_s")
        positive_float(self, path, "session_lease_s")
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ValueError(f"{path}.ssl_certfile: set it too (the certificate of serve.ssl_keyfile "
                             f"{self.ssl_keyfile}), or drop serve.ssl_keyfile")


@dataclass(kw_only=True)
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    """Run identity and output."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape, weights and dtype (shared by trainer and generator)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The torchtitan trainer."""
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    """The vLLM generator."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """GRPO algorithm."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The task's tokenizer, prompts, data and reward settings (math, dataset)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation on the generator that serves training."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """What a run logs besides the per-step scalars: sample completions, Weights & Biases."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """Trainer -> generator weight sync."""
    serve: ServeConfig = field(default_factory=ServeConfig)
    """The rollout server: its address, port and shared token (the server and the trainer read the same section)."""
    batch_invariant_mode: bool = False
    """Bitwise-identical trainer and generator logprobs (both sides switch kernels)."""
    resume: bool = False
    """Continue the newest run in job.output_dir (or job.output_dir itself when it is a run folder) from its newest
    checkpoint that verifies; with nothing to resume, exit 2."""
    resume_if_any: bool = False
    """As resume, but start a new run when there is nothing to resume (a job a scheduler may restart)."""
    dry_run: bool = False
    """Validate the config, write it to job.output_dir/dry-run.toml and exit without training."""
