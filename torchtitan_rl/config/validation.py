"""Checks across config sections, and what a run derives from several of them.

Each section checks its own fields (``check`` in job_config.py); here is only
what needs two sections or the torchrun world size. Every user mistake is a
``ValueError("field.path: message")``; ``validate`` runs every independent
check and refuses a config once, naming each problem.
"""

import dataclasses
import os
from pathlib import Path
from typing import Any

from torchtitan_rl.config.checks import Problems, check_finite, get, leaf_types, positive
from torchtitan_rl.config.job_config import REDACTED, SECRETS, EvalSetConfig, HarnessLengthsConfig, JobConfig

_SECTIONS = ("job", "trainer", "grpo", "metrics", "generator", "model", "task", "eval", "weight_sync")


def validate(cfg: JobConfig, *, world_size: int = 1, device: str | None = None) -> None:
    """Raise ValueError("field.path: message") for impossible settings, every independent check's problem in one
    (``checks.Problems``). ``device``: the device type the run found for job.device 'auto' (a run passes it;
    parsing, without torch, checks job.device as written)."""
    problems = Problems()
    problems.check(check_finite, cfg)
    for name in _SECTIONS:
        problems.check(getattr(cfg, name).check, name)
    for check in (_check_sampling, _check_lengths, _check_task, _check_harness_lengths, _check_eval, _check_partial):
        problems.check(check, cfg)
    for i, s in enumerate(cfg.eval.sets):
        problems.check(_check_eval_set, cfg, s, where=f"eval.sets[{i}]")
    problems.check(_check_layout, cfg, world_size=world_size, device=device or cfg.job.device)
    if cfg.batch_invariant_mode:
        problems.check(_check_batch_invariant, cfg)
    problems.raise_any()


def _check_sampling(cfg: JobConfig) -> None:
    sampling = cfg.generator.sampling
    if (sampling.top_p < 1 or sampling.top_k != -1) and cfg.grpo.importance_correction != "off":
        # vLLM reports logprobs of the truncated distribution it samples from, the trainer scores the full
        # one: rho = pi_old / pi_generator would shrink every kept token by the mass cut off (docs/design.md).
        raise ValueError(
            f"grpo.importance_correction: '{cfg.grpo.importance_correction}' needs the generator's logprobs of the "
            f"full distribution, but generator.sampling.top_p {sampling.top_p} / top_k {sampling.top_k} make "
            "them the truncated one's; set top_p 1 and top_k -1, or importance_correction 'off'"
        )
    if cfg.grpo.overlong == "soft_penalty" and not 0 < cfg.grpo.overlong_buffer <= sampling.max_tokens:
        raise ValueError(f"grpo.overlong_buffer: must be in [1, generator.sampling.max_tokens "
                         f"{sampling.max_tokens}], got {cfg.grpo.overlong_buffer}")


def _check_lengths(cfg: JobConfig) -> None:
    max_tokens, max_len = cfg.generator.sampling.max_tokens, cfg.generator.max_model_len
    if max_tokens >= max_len:
        raise ValueError(
            f"generator.sampling.max_tokens: {max_tokens} leaves no room for a prompt in "
            f"generator.max_model_len {max_len}"
        )
    if max_len > cfg.model.max_seq_len:
        raise ValueError(
            f"generator.max_model_len: {max_len} exceeds model.max_seq_len {cfg.model.max_seq_len}"
        )
    for name in ("micro_batch_tokens", "recompute_micro_batch_tokens"):
        budget = getattr(cfg.trainer, name)
        if 0 < budget < max_len:  # trainer/micro_batches.py never splits a row: one this long would pass the budget
            raise ValueError(f"trainer.{name}: {budget} tokens is less than generator.max_model_len {max_len}, the "
                             f"longest row, and a row is never split over micro-batches; set at least {max_len} "
                             "(or 0: micro_batch_size rows only)")
    if cfg.generator.load_format == "auto" and cfg.model.hf_checkpoint is None:
        raise ValueError("generator.load_format: 'auto' needs model.hf_checkpoint to be set")


def _check_layout(cfg: JobConfig, *, world_size: int, device: str) -> None:
    """Where each part runs: the transport, the torchrun world, the parallel degrees and the rows per rank (one
    chain: each check relies on the ones before)."""
    replicas = cfg.generator.parallelism.data_parallel_replicate_degree
    if cfg.weight_sync.transport == "nccl":
        _check_own_rank_generator(cfg, world_size)
        world_size -= replicas  # the last ranks hold the generator replicas; the trainer has the others
    else:
        if replicas != 1:
            raise ValueError(
                "generator.parallelism.data_parallel_replicate_degree: generator replicas each take a torchrun "
                f"rank of their own (weight_sync.transport 'nccl'); with '{cfg.weight_sync.transport}' there is "
                f"one engine, so it must be 1, got {replicas}"
            )
        cfg.generator.parallelism.check("generator.parallelism", world_size=world_size, exact=False)
    if cfg.weight_sync.transport == "server":
        check_serve(cfg)
    if cfg.generator.stream_groups and cfg.grpo.old_logprobs != "recompute":
        raise ValueError("generator.stream_groups: overlaps the recompute of pi_old with the tail, which "
                         "grpo.old_logprobs 'train' does not run; set one of them back")
    if cfg.generator.stream_groups and cfg.weight_sync.transport != "nccl":
        raise ValueError(f"generator.stream_groups: groups stream from a generator on its own rank (weight_sync."
                         f"transport 'nccl'); with '{cfg.weight_sync.transport}' the trainer's ranks generate them")
    if cfg.generator.inflight_updates:
        if cfg.weight_sync.transport != "nccl":
            raise ValueError(f"generator.inflight_updates: a sync lands in a running generate on the generator's own "
                             f"rank (weight_sync.transport 'nccl'); got '{cfg.weight_sync.transport}'")
    if cfg.generator.overlap_training:
        if cfg.weight_sync.transport != "inplace":
            raise ValueError(f"generator.overlap_training: overlaps a colocated engine's generate with training "
                             f"(weight_sync.transport 'inplace'); '{cfg.weight_sync.transport}' overlaps them already")
        if cfg.grpo.max_staleness < 1:
            raise ValueError("generator.overlap_training: needs grpo.max_staleness >= 1 (a request made ahead is what "
                             "runs while the trainer trains); got 0")
        if cfg.generator.sleep != "off":
            raise ValueError(f"generator.overlap_training: the engine generates while the trainer steps, so it cannot "
                             f"sleep then; set generator.sleep off (got '{cfg.generator.sleep}')")
    if cfg.generator.sleep != "off" and cfg.weight_sync.transport != "inplace":
        raise ValueError(f"generator.sleep: '{cfg.generator.sleep}' frees a colocated engine's memory while the "
                         f"trainer steps; weight_sync.transport '{cfg.weight_sync.transport}' has none, set it off")
    if cfg.trainer.cpu_offload and cfg.weight_sync.transport != "inplace":
        raise ValueError(f"trainer.cpu_offload: supported with weight_sync.transport 'inplace' only, got "
                         f"'{cfg.weight_sync.transport}'; use trainer.master_dtype bfloat16 to halve the trainer state")
    if cfg.trainer.cpu_offload and device == "cpu":
        raise ValueError("trainer.cpu_offload: moves the trainer's state from the GPU into host memory, where a CPU "
                         "run (job.device cpu) keeps it already; set it false")
    if cfg.generator.sleep == "weights" and not cfg.weight_sync.enable:
        raise ValueError("generator.sleep: 'weights' drops the engine's weights every step and only a sync brings "
                         "them back; weight_sync.enable false syncs once, use 'kv_cache' or 'off'")
    cfg.trainer.parallelism.check("trainer.parallelism", world_size=world_size, exact=True)
    _check_rows_per_rank(cfg, dp=world_size // cfg.trainer.parallelism.tensor_parallel_degree)


def effective_task(cfg: JobConfig) -> str:
    """The task this run trains on: grpo.task, or grpo.task_without_checkpoint on random weights."""
    if cfg.model.hf_checkpoint is None and cfg.grpo.task_without_checkpoint is not None:
        return cfg.grpo.task_without_checkpoint
    return cfg.grpo.task


def harness_lengths(cfg: JobConfig) -> HarnessLengthsConfig | None:
    """The drawn response lengths this run's generates take (engine/lengths.py): grpo.harness_lengths on the
    timing harness (grpo.task_without_checkpoint without model.hf_checkpoint), else None (lengths as they come,
    up to generator.sampling.max_tokens)."""
    lengths = cfg.grpo.harness_lengths
    harness = cfg.model.hf_checkpoint is None and cfg.grpo.task_without_checkpoint is not None
    return lengths if harness and lengths.distribution != "fixed" else None


def _check_harness_lengths(cfg: JobConfig) -> None:
    """grpo.harness_lengths needs the timing harness and a layout whose generate draws them (Engine.generate)."""
    if cfg.grpo.harness_lengths.distribution == "fixed":
        return
    if cfg.model.hf_checkpoint is None and cfg.grpo.task_without_checkpoint is None:
        raise ValueError(
            f"grpo.harness_lengths: '{cfg.grpo.harness_lengths.distribution}' sets the timing harness's lengths "
            "(grpo.task_without_checkpoint without model.hf_checkpoint); set grpo.task_without_checkpoint, or "
            "distribution 'fixed'")
    if harness_lengths(cfg) is None:
        return  # real weights: ignored, as grpo.task_without_checkpoint is
    if cfg.weight_sync.transport == "server":
        raise ValueError("grpo.harness_lengths: drawn lengths are set by the in-process engine "
                         "(weight_sync.transport inplace or nccl), not through the rollout server's HTTP API")
    if effective_task(cfg).partition(":")[0] == "calculator":
        raise ValueError("grpo.harness_lengths: drawn lengths are for a single-turn harness task; "
                         "grpo.task_without_checkpoint 'calculator' plays multi-turn episodes")


def tokenizer_dir(cfg: JobConfig) -> str | None:
    """The folder the run's task tokenizes with (and an export copies): task.tokenizer, else the checkpoint's."""
    return cfg.task.tokenizer or cfg.model.hf_checkpoint


def _check_task(cfg: JobConfig) -> None:
    """What grpo.task needs of the task section (the files are read when the task is built)."""
    task, name = cfg.task, effective_task(cfg).partition(":")[0]
    if name in ("math", "calculator", "dataset") and tokenizer_dir(cfg) is None:
        raise ValueError(
            f"task.tokenizer: grpo.task '{name}' renders prompts with a chat template; set task.tokenizer "
            "or model.hf_checkpoint to a folder with tokenizer.json"
        )
    if name == "dataset":
        if task.path is None:
            raise ValueError("task.path: grpo.task 'dataset' needs a JSONL or Parquet file")
        for field in ("path", "heldout_path"):
            path = getattr(task, field)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"task.{field}: file not found: {path}")


def _check_eval(cfg: JobConfig) -> None:
    if cfg.eval.max_tokens >= cfg.generator.max_model_len:
        raise ValueError(
            f"eval.max_tokens: {cfg.eval.max_tokens} leaves no room for a prompt in "
            f"generator.max_model_len {cfg.generator.max_model_len}"
        )
    if cfg.eval.every_n_steps and not cfg.eval.sets and effective_task(cfg).partition(":")[0] == "digits":
        # Every digit string can be drawn for training: nothing is held out.
        raise ValueError("eval.every_n_steps: grpo.task 'digits' has no held-out set; use 'math' or 'dataset', "
                         "or add eval.sets")
    if cfg.eval.sets and tokenizer_dir(cfg) is None:
        raise ValueError("eval.sets: a named set is asked in the chat template of task.tokenizer or "
                         "model.hf_checkpoint; set one")


def _check_eval_set(cfg: JobConfig, s: EvalSetConfig, *, where: str) -> None:
    if not Path(s.path).exists():
        raise ValueError(f"{where}.path: not found: {s.path}")
    if s.max_tokens >= cfg.generator.max_model_len:
        raise ValueError(f"{where}.max_tokens: {s.max_tokens} leaves no room for a prompt in "
                         f"generator.max_model_len {cfg.generator.max_model_len}")


def _check_partial(cfg: JobConfig) -> None:
    """grpo.partial against the sections it meets (docs/design.md, "Partial rollouts and in-flight updates")."""
    partial, S = cfg.grpo.partial, cfg.grpo.max_staleness
    if not partial.enable:
        return
    if partial.max_token_age < 2 * S + 1:
        raise ValueError(f"grpo.partial.max_token_age: {partial.max_token_age} is below 2 x grpo.max_staleness + 1 "
                         f"= {2 * S + 1}, the age of a carried token at the first step that can continue it")
    if cfg.grpo.dynamic_sampling:
        raise ValueError("grpo.dynamic_sampling: not with grpo.partial.enable (its refills are whole generates of "
                         "their own); over-sample with grpo.partial.over_sample instead")
    if cfg.weight_sync.transport == "server":
        raise ValueError("grpo.partial.enable: the rollout server (weight_sync.transport 'server') answers whole "
                         "completions only; use 'inplace' or 'nccl'")
    if not cfg.weight_sync.enable:
        raise ValueError("grpo.partial.enable: its bound counts weight versions, which weight_sync.enable false "
                         "never advances; turn one of them off")


def _check_rows_per_rank(cfg: JobConfig, *, dp: int) -> None:
    """A step's P x G rows split evenly over the ``dp`` data-parallel trainer ranks, and each rank's rows
    into grpo.mini_batches non-empty parts (an empty part would silently skip an optimizer step)."""
    rows = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    if rows % dp:
        raise ValueError(f"grpo.prompts_per_step: grpo.prompts_per_step x grpo.group_size ({rows}) must divide "
                         f"over the {dp} data-parallel trainer ranks")
    if cfg.grpo.mini_batches > rows // dp:
        raise ValueError(f"grpo.mini_batches: {cfg.grpo.mini_batches} is more than the {rows // dp} rows each "
                         f"data-parallel trainer rank trains on (grpo.prompts_per_step x grpo.group_size / {dp})")


def _check_batch_invariant(cfg: JobConfig) -> None:
    if cfg.model.dtype != "bfloat16":
        raise ValueError(f"batch_invariant_mode: needs model.dtype 'bfloat16', got '{cfg.model.dtype}'")
    tp_t = cfg.trainer.parallelism.tensor_parallel_degree
    tp_g = cfg.generator.parallelism.tensor_parallel_degree
    if tp_t != 1 or tp_g != 1:
        # Row-parallel linears sum their shards in an all-reduce, on the trainer and in vLLM, in different orders.
        raise ValueError(
            "batch_invariant_mode: needs trainer.parallelism.tensor_parallel_degree and "
            f"generator.parallelism.tensor_parallel_degree 1, got {tp_t} and {tp_g} "
            "(a sharded matmul reduces in a different order)"
        )
    s = cfg.generator.sampling
    if s.top_p != 1.0 or s.top_k != -1:
        # vLLM reports logprobs of the top-p/top-k renormalised distribution: the full-vocabulary recompute differs.
        raise ValueError(
            f"batch_invariant_mode: needs generator.sampling.top_p 1 and top_k -1, got {s.top_p} and {s.top_k}"
        )
    if cfg.generator.kv_cache_dtype != "auto":
        raise ValueError(f"batch_invariant_mode: needs generator.kv_cache_dtype 'auto', got "
                         f"'{cfg.generator.kv_cache_dtype}' (the trainer attends over unrounded keys and values)")
    if cfg.generator.attention_backend not in ("auto", "FLASH_ATTN"):
        raise ValueError(f"batch_invariant_mode: needs generator.attention_backend 'auto' or 'FLASH_ATTN', got "
                         f"'{cfg.generator.attention_backend}' (its kernel reads the KV cache in FLASH_ATTN's layout)")
    if cfg.model.lora.rank and cfg.model.lora.sync == "merged":
        raise ValueError(
            "batch_invariant_mode: needs model.lora.sync 'adapter' (merged W + BA cannot be "
            "bitwise equal to the trainer's unmerged forward)"
        )
    if cfg.grpo.old_logprobs != "recompute":
        raise ValueError("batch_invariant_mode: needs grpo.old_logprobs 'recompute' (its no-grad forward is the one "
                         "whose logprobs equal the generator's bit for bit)")


def redacted_dict(cfg: JobConfig) -> dict[str, Any]:
    """The config as nested dicts with the secrets shown as REDACTED (for loggers that upload their run's config)."""
    data = dataclasses.asdict(cfg)
    for path in SECRETS:
        table, name = path.split(".")
        if data[table][name]:
            data[table][name] = REDACTED
    return data


def check_serve(cfg: JobConfig) -> None:
    """The serve section, for the rollout server and for a trainer that uses it (transport=server).

    Secrets not given (or read back redacted from a run's config.toml) are taken from the environment."""
    for name, env in SECRETS.items():
        field = name.split(".")[1]
        if getattr(cfg.serve, field) in ("", REDACTED) and os.environ.get(env):
            setattr(cfg.serve, field, os.environ[env])
        if getattr(cfg.serve, field) == REDACTED:
            raise ValueError(f"{name}: the config file shows it redacted; pass it with --{name} or {env}")
    cfg.serve.check("serve")
    positive(cfg.weight_sync, "weight_sync", "peer_timeout_s")
    if cfg.model.lora.rank and cfg.model.lora.sync == "merged":
        raise ValueError("model.lora.sync: 'merged' is not supported by the rollout server; use 'adapter'")
    per_step = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    if per_step > cfg.serve.max_n:
        raise ValueError(f"serve.max_n: {cfg.serve.max_n} is less than the {per_step} completions a step asks for "
                         "(grpo.prompts_per_step x grpo.group_size)")
    for name in ("tensor_parallel_degree", "data_parallel_replicate_degree"):
        if getattr(cfg.generator.parallelism, name) != 1:
            raise ValueError(
                f"generator.parallelism.{name}: the rollout server runs one engine on one device, "
                f"so it must be 1, got {getattr(cfg.generator.parallelism, name)}"
            )


def _check_own_rank_generator(cfg: JobConfig, world_size: int) -> None:
    """transport=nccl: trainer ranks + R generator replicas, one rank and one device each (rollout/remote.py)."""
    par = cfg.generator.parallelism
    replicas = par.data_parallel_replicate_degree
    if replicas < 1:
        raise ValueError(f"generator.parallelism.data_parallel_replicate_degree: must be >= 1, got {replicas}")
    if world_size < replicas + 1:
        ranks = "1 generator rank" if replicas == 1 else f"{replicas} generator replicas"
        raise ValueError(
            "weight_sync.transport: 'nccl' puts the generator on its own rank; run under torchrun with "
            f">= {replicas + 1} processes (trainer ranks + {ranks}), got world size {world_size}"
        )
    if par.data_parallel_shard_degree != 1:
        raise ValueError(
            "generator.parallelism.data_parallel_shard_degree: a generator replica holds the whole model, so it "
            f"must be 1, got {par.data_parallel_shard_degree} (more generator devices: "
            "generator.parallelism.data_parallel_replicate_degree)"
        )
    if par.tensor_parallel_degree != 1:
        # Not built: vLLM's TP group would have to span our torchrun ranks (docs/scaling.md).
        raise ValueError(
            "generator.parallelism.tensor_parallel_degree: weight_sync.transport 'nccl' gives each generator "
            f"replica one rank and one device, so it must be 1, got {par.tensor_parallel_degree} (the generator's "
            "torchtitan model is not sharded inside vLLM; more generator devices: "
            "generator.parallelism.data_parallel_replicate_degree)"
        )
    if cfg.model.lora.rank and cfg.model.lora.sync == "merged":
        # NcclSender moves the trainer's tensors as they are; merging W + BA is WeightSync's (in place) only.
        raise ValueError(
            "model.lora.sync: 'merged' is not supported with weight_sync.transport 'nccl'; use 'adapter'"
        )


def config_diff(old: JobConfig, new: JobConfig) -> list[tuple[str, Any, Any]]:
    """(field.path, old value, new value) of every leaf field that differs, in the tree's order."""
    return [(path, get(old, path), get(new, path)) for path in leaf_types(JobConfig)
            if get(old, path) != get(new, path)]
