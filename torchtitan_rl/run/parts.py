"""What a run is made of, read from its config: the task, the model shape and the device.

The training loop, the rollout server and export build the same three from the same config.
"""

import os

import torch

from torchtitan_rl.config import JobConfig
from torchtitan_rl.config.validation import effective_task, harness_lengths, tokenizer_dir
from torchtitan_rl.distributed.process_group import local_device
from torchtitan_rl.grpo import build_task
from torchtitan_rl.grpo.tasks import check_vocabulary
from torchtitan_rl.models.families import FLAVORS, resolve_shape
from torchtitan_rl.models.hf_folder import check_hf_folder


def run_task(cfg: JobConfig):
    """The run's task (config.validation.effective_task) built with the task section and its tokenizer folder
    (task.tokenizer, else the checkpoint's)."""
    for field, folder in (("model.hf_checkpoint", cfg.model.hf_checkpoint), ("task.tokenizer", cfg.task.tokenizer)):
        if folder is not None:  # before transformers or safetensors read a file of it
            check_hf_folder(folder, field=field)
    spec = effective_task(cfg)
    if spec != cfg.grpo.task and os.environ.get("RANK", "0") == "0":
        print(f"torchtitan_rl: no model.hf_checkpoint: seeded random weights and grpo.task_without_checkpoint "
              f"{spec!r}: a timing harness, nothing will learn (--model.hf_checkpoint DIR trains {cfg.grpo.task!r})")
    if (lengths := harness_lengths(cfg)) is not None and os.environ.get("RANK", "0") == "0":
        print(f"torchtitan_rl: harness response lengths: {lengths.distribution}, median {lengths.median}, p90 "
              f"{lengths.p90}, cap {cfg.generator.sampling.max_tokens} tokens, eos ignored (grpo.harness_lengths)")
    completion = max(cfg.generator.sampling.max_tokens, cfg.eval.max_tokens)
    return build_task(spec, cfg.task, tokenizer_dir=tokenizer_dir(cfg),
                      max_prompt_tokens=cfg.generator.max_model_len - completion)


def run_shape(cfg: JobConfig, task):
    """The run's model shape; the tiny flavors (vocab 0) take the task tokenizer's vocabulary."""
    flavor = FLAVORS.get(cfg.model.flavor)
    takes_task_vocab = flavor is not None and flavor.vocab_size == 0  # the tiny flavors
    shape = resolve_shape(
        flavor=cfg.model.flavor,
        hf_checkpoint=cfg.model.hf_checkpoint,
        vocab_size=cfg.model.vocab_size or (task.vocab_size if takes_task_vocab else 0),
        max_seq_len=cfg.model.max_seq_len,
        load_balance_coeff=cfg.model.moe_load_balance_coeff,
    )
    check_vocabulary(
        task, spec=effective_task(cfg), model_vocab_size=shape.vocab_size, hf_checkpoint=cfg.model.hf_checkpoint
    )
    check_moe(cfg, shape)
    return shape


def check_moe(cfg: JobConfig, shape) -> None:
    """What an MoE model (or a dense one) refuses of the config, in one line naming the field."""
    ep = cfg.trainer.parallelism.expert_parallel_degree
    if not shape.moe:
        if cfg.grpo.routing_replay:
            raise ValueError(f"grpo.routing_replay: {shape.family.hf_architecture} has no experts to route; "
                             "set it false")
        if ep != 1:
            raise ValueError(f"trainer.parallelism.expert_parallel_degree: {shape.family.hf_architecture} has no "
                             f"experts to place; set it 1, got {ep}")
        return
    if shape.num_experts % ep:
        raise ValueError(f"trainer.parallelism.expert_parallel_degree: {ep} does not divide the model's "
                         f"{shape.num_experts} experts")
    if cfg.grpo.old_logprobs != "recompute":
        raise ValueError("grpo.old_logprobs: 'train' skips the recompute, which records the trainer's expert choices "
                         "(routing_mismatch, grpo.routing_replay); use 'recompute' for an MoE model")
    if cfg.batch_invariant_mode:
        raise ValueError("batch_invariant_mode: not for MoE models: vLLM's fused-MoE kernels sum each token's "
                         "experts in an order that depends on the batch, and there is no batch-invariant "
                         "kernel of them to run on both sides; set it false")
    if cfg.grpo.routing_replay and cfg.weight_sync.transport != "inplace":
        raise ValueError(f"grpo.routing_replay: needs the generator's expert choices, which only a colocated "
                         f"engine hands over (weight_sync.transport 'inplace', got '{cfg.weight_sync.transport}')")
    if cfg.grpo.partial.enable:
        raise ValueError("grpo.partial.enable: a cut sample's expert choices would span the generates that sampled "
                         "it, which the route log does not join (routing_mismatch, grpo.routing_replay); set it "
                         "false for an MoE model")
    if cfg.generator.stream_groups:
        raise ValueError("generator.stream_groups: a streamed group is recomputed before its expert choices are "
                         "filed (routing_mismatch, grpo.routing_replay); set it false for an MoE model")
    lora = cfg.model.lora
    if lora.rank and not {"wqkv", "wo"} & set(lora.target_modules):
        raise ValueError(f"model.lora.target_modules: {list(lora.target_modules)} are the dense MLP's linears, which "
                         "an MoE model has none of (its experts are stacked tensors, frozen under LoRA); target "
                         "attention's 'wqkv' / 'wo'")
    if shape.load_balance_coeff and (cfg.job.export or cfg.job.export_dir):
        raise ValueError("model.moe_load_balance_coeff: > 0 gives every MoE layer a routing bias that HF "
                         "Qwen3MoeForCausalLM has no place for, so job.export / job.export_dir would write another "
                         "model; set it 0 or export nothing")


def run_device(name: str):
    """job.device as a torch.device (this rank's GPU under torchrun)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "job.device: this config needs a CUDA GPU and torch finds none; on a CPU run "
                "run_configs/cpu_tiny.toml or run_configs/smollm2_135m_math_cpu.toml (or --job.device cpu)"
            )
        device, visible = local_device("cuda"), torch.cuda.device_count()
        if device.index >= visible:
            raise ValueError(
                f"job.device: torchrun's local rank {device.index} needs GPU {device.index}, but {visible} "
                f"{'is' if visible == 1 else 'are'} visible; run at most --nproc-per-node {visible} per machine"
            )
        return device
    return torch.device(name)
