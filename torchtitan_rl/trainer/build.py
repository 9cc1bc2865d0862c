"""Build the trainer's model: torchtitan's decoder from a seed or HF weights, LoRA, batch-invariant kernels,
activation checkpointing, then FSDP2/TP/EP through torchtitan's parallelize (trainer/trainer.py calls it once)."""

import functools
from pathlib import Path

import torch
import torch.utils.checkpoint
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, TrainingConfig
from torchtitan.config import ParallelismConfig as TitanParallelismConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.models.qwen3 import parallelize_qwen3
from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

from torchtitan_rl import compat
from torchtitan_rl.config.job_config import ModelConfig, TrainerConfig
from torchtitan_rl.kernels.batch_invariant import make_batch_invariant
from torchtitan_rl.models.lora import apply_lora
from torchtitan_rl.models.shape import ModelShape, titan_config
from torchtitan_rl.trainer.hf_weights import load_hf_weights, load_hf_weights_sharded
from torchtitan_rl.trainer.logprobs import identity


def build_parallel_model(
    config: TrainerConfig,
    *,
    model_config: ModelConfig,
    shape: ModelShape,
    seed: int,
    device: torch.device,
    parallel_dims: ParallelDims,
    output_dir: Path,
    batch_invariant: bool,
    sharded_hf_load: bool,
) -> tuple[torch.nn.Module, bool, int]:
    """The parallelized model (FSDP2/TP/EP, fp32 masters), whether torch.compile is on, and the logprob chunk size
    in tokens (0: the model returns whole logits). ``sharded_hf_load``: as Trainer's argument of that name."""
    titan_parallelism = TitanParallelismConfig(
        data_parallel_replicate_degree=parallel_dims.dp_replicate,
        data_parallel_shard_degree=parallel_dims.dp_shard,
        tensor_parallel_degree=parallel_dims.tp,
        expert_parallel_degree=parallel_dims.ep,
        spmd_backend="partial_dtensor",
    )
    # Every rank builds the whole model from the same seed (or HF weights), then parallelize keeps each rank's
    # shard: init is world-size free.
    sharded_hf_load = sharded_hf_load and reads_hf_shards(model_config, shape=shape, batch_invariant=batch_invariant)
    model = build_model(shape, seed=seed, device=torch.device("meta") if sharded_hf_load else device,
                        parallelism=titan_parallelism,
                        dtype=block_dtype(config.master_dtype, model_config, batch_invariant=batch_invariant))
    if model_config.hf_checkpoint is not None and not sharded_hf_load:
        load_hf_weights(model, shape=shape, hf_dir=model_config.hf_checkpoint)
    if batch_invariant:
        # The generator runs the same kernels (engine/vllm_model.py), so
        # logprobs match bit for bit.
        make_batch_invariant(model, replace_attention=True, device=device)
    if model_config.lora.rank:
        torch.manual_seed(seed)  # adapter init, the same on every rank
        apply_lora(model, model_config.lora)
    # Batch-invariant mode keeps whole logits (its sampler kernels read them) and its own
    # uncompiled kernels; tensor parallel keeps them too (its lm_head output is vocab-sharded).
    compile_ = config.compile and not batch_invariant
    chunk_tokens = 0  # >0: the model returns final hidden states and logprobs come from trainer/logprobs.py
    if config.logprob_chunk_tokens and not batch_invariant and parallel_dims.tp == 1:
        assert not hasattr(model.lm_head, "lora_a"), "lm_head is no LoRA target (config.validation checks)"
        chunk_tokens = config.logprob_chunk_tokens
        # The lm_head module stays in the forward (FSDP's hooks unshard its weight and
        # keep it unsharded for the backward), but returns its input: the matmul is ours.
        model.lm_head.forward = identity
    if config.master_dtype == "bfloat16":  # parameters only: the RoPE buffers stay float32
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
    if config.activation_checkpoint == "full":
        for block in model.layers.values():
            checkpoint_forward(block)
    training = TrainingConfig(
        mixed_precision_param=model_config.dtype, mixed_precision_reduce="float32",
        enable_cpu_offload=config.cpu_offload and device.type == "cuda",
    )
    model = parallelize_qwen3(
        model,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=titan_parallelism,
        compile_config=CompileConfig(enable=compile_, components=["model"]),
        ac_config=None,
        dump_folder=str(output_dir),
        skip_dp=parallel_dims.ep > 1,
    )
    if parallel_dims.ep > 1:
        compat.titan_expert_all_to_all()
        shard_with_expert_mesh(model, parallel_dims=parallel_dims, training=training)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # torchtitan turns off FSDP's gradient averaging (we normalise by the
            # global token count), and FSDP then reduces with PREMUL_SUM(1.0),
            # which gloo lacks; a plain SUM is the same reduction.
            module.set_force_sum_reduction_for_comms(True)
    if sharded_hf_load:
        # trainer.cpu_offload: FSDP keeps the shards in host memory (as torchtitan's own meta-device init)
        offload = config.cpu_offload and device.type == "cuda"
        model.to_empty(device=torch.device("cpu") if offload else device)
        with torch.no_grad():
            model.init_states(buffer_device=device)  # the RoPE buffers; the weights come next
        load_hf_weights_sharded(model, shape=shape, hf_dir=model_config.hf_checkpoint)
    return model, compile_, chunk_tokens


def reads_hf_shards(model_config: ModelConfig, *, shape: ModelShape, batch_invariant: bool) -> bool:
    """Whether each rank may read only its shard of the HF weights onto a model that starts on the meta device
    (HF weights overwrite every parameter). Not with LoRA, whose adapters are drawn on the whole model, nor in
    batch-invariant mode; not for MoE: its HF experts are one tensor each, stacked per layer (a whole-model load
    does that). run/memory.py counts the build by it too."""
    return (model_config.hf_checkpoint is not None and not model_config.lora.rank and not batch_invariant
            and not shape.moe)


def block_dtype(master_dtype: str, model_config: ModelConfig, *, batch_invariant: bool) -> torch.dtype:
    """The dtype build_model casts each decoder block to right after its init: bfloat16 masters' own, except where
    LoRA's or batch-invariant mode's changes to a block read its dtype (those models are cast whole after, as every
    model was before). run/memory.py counts the build by it too."""
    if master_dtype == "bfloat16" and not model_config.lora.rank and not batch_invariant:
        return torch.bfloat16
    return torch.float32


def shard_with_expert_mesh(model: torch.nn.Module, *, parallel_dims: ParallelDims, training: TrainingConfig) -> None:
    """FSDP2 under expert parallelism: each block's experts by their own fully_shard over the ranks that share
    them ("efsdp"), then torchtitan's decoder sharding over "fsdp", which skips what is already sharded.
    torchtitan 0.3 does this with FSDP's per-parameter meshes, which torch 2.11 (vLLM 0.26's) lacks; nesting is
    the same layout on both."""
    replicate = ["dp_replicate"] if parallel_dims.dp_replicate_enabled else []
    param_dtype = TORCH_DTYPE_MAP[training.mixed_precision_param]
    reduce_dtype = TORCH_DTYPE_MAP[training.mixed_precision_reduce]
    offload = {"offload_policy": CPUOffloadPolicy()} if training.enable_cpu_offload else {}
    for block in model.layers.values():
        fully_shard(
            block.moe.routed_experts.inner_experts, mesh=parallel_dims.get_mesh(replicate + ["efsdp"]),
            mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                           cast_forward_inputs=False),
            **offload,
        )
    apply_fsdp_to_decoder(
        model, parallel_dims.get_mesh(replicate + ["fsdp"]), param_dtype=param_dtype, reduce_dtype=reduce_dtype,
        pp_enabled=False, cpu_offload=training.enable_cpu_offload,
    )


def build_model(
    shape: ModelShape, *, seed: int, device: torch.device, parallelism: TitanParallelismConfig,
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """build_titan_model, plus the tensor-parallel sharding plan torchtitan reads at build; the decoder blocks'
    parameters in ``dtype``, initialized in float32 (the same values as a float32 model cast after)."""
    config = titan_config(shape)
    tp, ep = parallelism.tensor_parallel_degree, parallelism.expert_parallel_degree
    if tp > 1 and shape.num_key_value_heads % tp:
        raise ValueError(
            f"trainer.parallelism.tensor_parallel_degree: {tp} does not divide "
            f"the model's {shape.num_key_value_heads} KV heads"
        )
    if tp > 1 or ep > 1:
        # torchtitan reads each module's TP / EP layout from its config at build time.
        # (Qwen3Model.Config.update_from_config does this too, but imports
        # torchtitan's whole Trainer, HF datasets included.)
        set_qwen3_sharding_config(
            config, enable_sp=parallelism.enable_sequence_parallel, enable_ep=ep > 1
        )
    with torch.device("meta"):
        model = config.build()
    # The blocks come to the device one at a time, inside torchtitan's init (its order of init calls, so the same
    # random values): the device holds the model in ``dtype`` plus one float32 block, not the whole model in float32
    # (30B-A3B: 122 GB, more than an 80 GB GPU, before FSDP keeps a rank's shard).
    model.to_empty(device=device, recurse=False)
    for name, child in model.named_children():
        if name != "layers":
            child.to_empty(device=device)
    for block in model.layers.values():
        block.init_states = functools.partial(_init_block, block, block.init_states, device=device, dtype=dtype)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_states(buffer_device=device)
    for block in model.layers.values():
        del block.init_states  # back to the class's method
    return model


def _init_block(block: torch.nn.Module, init_states, *, device: torch.device, dtype: torch.dtype, **kwargs) -> None:
    """One decoder block materialized on ``device``, initialized by torchtitan's ``init_states``, then cast."""
    block.to_empty(device=device)
    init_states(**kwargs)
    if dtype != torch.float32:
        for param in block.parameters():
            param.data = param.data.to(dtype)


def checkpoint_forward(block: torch.nn.Module) -> None:
    """Activation checkpointing of one decoder block, in place.

    The block's forward is wrapped rather than the block (torchtitan's
    checkpoint_wrapper), so parameter names, which the sync plan and the
    checkpoints use, do not change.
    """
    forward = block.forward

    def checkpointed(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed
