"""JobConfig from TOML + command line, checked, and back to TOML.

Precedence: command line > ``--config FILE.toml`` > the defaults in
job_config.py. Every user mistake is a ``ValueError("field.path: message")``
(or tyro's own parse error); :func:`parse_args` is the CLI boundary that turns
either into one line on stderr and exit code 2.

``None`` in TOML: TOML has no null, so :func:`to_toml` omits a ``None`` field
and loading falls back to the default. That round-trips because every
``X | None`` field defaults to ``None`` (asserted in :func:`to_toml`).

No torch, no vLLM here: ``--help`` and config checks must stay instant.
"""

import contextlib
import dataclasses
import difflib
import io
import ipaddress
import json
import math
import os
import re
import sys
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from torchtitan_rl.config.job_config import JobConfig

_DESCRIPTION = (
    "GRPO post-training: torchtitan trainer + vLLM generator. "
    "--config FILE.toml loads a run config (see run_configs/); any flag below "
    "overrides it, e.g. --trainer.optimizer.lr 1e-4 (bools: --flag, --no-flag or "
    "--flag false). Precedence: command line > file > defaults; "
    "the defaults shown include the file's values."
)


# ---------------------------------------------------------------- TOML -> dataclass


def load_toml(path: str | os.PathLike) -> JobConfig:
    """Read a TOML file into a JobConfig; unknown keys and wrong types raise ValueError."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"--config: file not found: {path}") from None
    except OSError as e:
        raise ValueError(f"--config: cannot read {path}: {e.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        line = re.search(r"line (\d+)", str(e))
        where = f"{path}:{line.group(1)}" if line else str(path)
        raise ValueError(f"{where}: invalid TOML: {e}") from None
    return from_dict(data)


def from_dict(data: dict[str, Any]) -> JobConfig:
    """Build a JobConfig from nested dicts as tomllib returns them (strict)."""
    return _build(JobConfig(), data, "")


def _build(default: Any, data: dict[str, Any], prefix: str) -> Any:
    """default with data's keys replaced; nested tables start from default's sections
    (a generator's parallelism default differs from ParallelismConfig's)."""
    fields = {f.name: f for f in dataclasses.fields(default)}
    for key in data:
        if key not in fields:
            raise ValueError(_unknown_key(prefix + key, [prefix + n for n in fields]))
    kwargs = {}
    for name, value in data.items():
        tp, path = fields[name].type, prefix + name
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ValueError(f"{path}: expected a table, got {_describe(value)}")
            kwargs[name] = _build(getattr(default, name), value, path + ".")
        else:
            kwargs[name] = _coerce(value, tp, path)
    return dataclasses.replace(default, **kwargs)


def _unknown_key(path: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(path, valid, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else "valid: " + ", ".join(valid)
    return f"unknown key '{path}' ({hint})"


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        assert len(inner) == 1, f"{path}: only 'X | None' unions are supported"
        return _coerce(value, inner[0], path)
    if origin is Literal:
        if value not in args or type(value) is not type(args[0]):
            choices = ", ".join(repr(a) for a in args)
            raise ValueError(f"{path}: expected one of {choices}, got {_describe(value)}")
        return value
    if origin is tuple:
        n = "" if args[-1] is Ellipsis else f"{len(args)} "
        want = f"an array of {n}{_type_name(args[0])}"
        if not isinstance(value, list) or (n and len(value) != len(args)):
            raise ValueError(f"{path}: expected {want}, got {_describe(value)}")
        item_types = list(args) if n else [args[0]] * len(value)
        items = enumerate(zip(value, item_types))
        return tuple(_coerce(v, t, f"{path}[{i}]") for i, (v, t) in items)
    if tp is float and type(value) is int:
        return float(value)
    if type(value) is not tp:  # bool is not an int here, and int is not a str
        raise ValueError(f"{path}: expected {_type_name(tp)}, got {_describe(value)}")
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    kind = {dict: "table", list: "array"}.get(type(value), type(value).__name__)
    return f"{kind} {value!r}"


# ---------------------------------------------------------------- dataclass -> TOML


def to_toml(cfg: JobConfig) -> str:
    """TOML text that load_toml reads back to an equal config (None fields are omitted)."""
    lines: list[str] = []
    _emit(cfg, "", lines)
    return "\n".join(lines).strip() + "\n"


def write_toml(cfg: JobConfig, path: str | os.PathLike) -> None:
    """Write to_toml(cfg) to path, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(cfg))


def _emit(obj: Any, table: str, lines: list[str]) -> None:
    sub_tables = []
    if table:
        lines += ["", f"[{table}]"]
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            sub_tables.append((f.name, value))
        elif value is None:
            assert f.default is None, f"{table}.{f.name}: None must be the default to round-trip"
        else:
            secret = f"{table}.{f.name}" in SECRETS and value
            lines.append(f"{f.name} = {_toml_value(REDACTED if secret else value)}")
    for name, value in sub_tables:
        _emit(value, f"{table}.{name}" if table else name, lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # repr of a float is valid TOML: 1e-06, inf, nan
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON escapes are TOML escapes
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise AssertionError(f"cannot write {value!r} to TOML")


# ---------------------------------------------------------------- validation


def validate(cfg: JobConfig, *, world_size: int = 1) -> None:
    """Raise ValueError("field.path: message") for impossible settings."""
    _check_finite(cfg)
    _positive(cfg, "trainer.steps", "trainer.micro_batch_size", "grpo.prompts_per_step")
    _positive(cfg, "generator.sampling.max_tokens", "generator.max_model_len")
    _positive(cfg, "generator.max_num_seqs", "model.max_seq_len")
    _positive(cfg, "trainer.checkpoint.interval", "weight_sync.verify_samples")
    _positive(cfg, "weight_sync.bucket_mb")
    _at_least(cfg, 0, "trainer.checkpoint.keep_latest", "trainer.lr_scheduler.warmup_steps")
    _at_least(cfg, 0, "model.vocab_size", "trainer.max_grad_norm", "trainer.optimizer.lr")
    _at_least(cfg, 0, "trainer.optimizer.weight_decay", "grpo.kl_coef")
    _at_least(cfg, 0, "trainer.micro_batch_tokens", "trainer.recompute_micro_batch_tokens")
    _at_least(cfg, 0, "trainer.logprob_chunk_tokens")
    _at_least(cfg, 0, "generator.wait_for_weights_s", "trainer.optimizer.eps")
    # vLLM's range is [0, 2], but 0 (greedy) has no distribution the trainer could score: logits / 0.
    _in_range(cfg, "generator.sampling.temperature", 0, 2, "(0, 2]")
    _positive_float(cfg, "trainer.collective_timeout_s", "weight_sync.peer_timeout_s")
    _at_least(cfg, 2, "grpo.group_size")
    _at_least(cfg, 0, "grpo.max_staleness")
    if not cfg.grpo.importance_cap > 1:  # mask keeps [1/cap, cap]: at 1 it would drop almost every token
        raise ValueError(f"grpo.importance_cap: must be > 1, got {cfg.grpo.importance_cap}")
    _at_least(cfg, 0, "model.lora.rank")
    _in_range(cfg, "model.lora.dropout", 0, 1, "[0, 1)")
    if cfg.model.lora.rank and cfg.model.lora.alpha <= 0:
        raise ValueError(f"model.lora.alpha: must be > 0, got {cfg.model.lora.alpha}")
    known = {"wqkv", "wo", "w1", "w2", "w3"}
    unknown = [m for m in cfg.model.lora.target_modules if m not in known]
    if unknown or (cfg.model.lora.rank and not cfg.model.lora.target_modules):
        raise ValueError(
            f"model.lora.target_modules: unknown {unknown or 'empty'}; choose from {sorted(known)}"
        )

    _in_range(cfg, "grpo.clip_eps_low", 0, 1, "[0, 1)")
    _in_range(cfg, "grpo.clip_eps_high", 0, 1, "[0, 1)")
    _check_grpo_variants(cfg)
    _in_range(cfg, "generator.sampling.top_p", 0, 1, "(0, 1]")
    _in_range(cfg, "generator.gpu_memory_utilization", 0, 1, "(0, 1]")
    _in_range(cfg, "trainer.lr_scheduler.min_lr_ratio", 0, 1, "[0, 1]")
    for i, beta in enumerate(cfg.trainer.optimizer.betas):
        if not 0 <= beta < 1:
            raise ValueError(f"trainer.optimizer.betas[{i}]: must be in [0, 1), got {beta}")
    if cfg.generator.kv_cache_memory_gb <= 0:
        raise ValueError(
            f"generator.kv_cache_memory_gb: must be > 0, got {cfg.generator.kv_cache_memory_gb}"
        )
    top_k = cfg.generator.sampling.top_k
    if top_k != -1 and top_k < 1:
        raise ValueError(f"generator.sampling.top_k: must be -1 (off) or >= 1, got {top_k}")

    if (cfg.generator.sampling.top_p < 1 or top_k != -1) and cfg.grpo.importance_correction != "off":
        # vLLM reports logprobs of the truncated distribution it samples from, the trainer scores the full
        # one: rho = pi_old / pi_generator would shrink every kept token by the mass cut off (docs/design.md).
        raise ValueError(
            f"grpo.importance_correction: '{cfg.grpo.importance_correction}' needs the generator's logprobs of the "
            f"full distribution, but generator.sampling.top_p {cfg.generator.sampling.top_p} / top_k {top_k} make "
            "them the truncated one's; set top_p 1 and top_k -1, or importance_correction 'off'"
        )

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
    if cfg.generator.load_format == "auto" and cfg.model.hf_checkpoint is None:
        raise ValueError("generator.load_format: 'auto' needs model.hf_checkpoint to be set")

    _check_task(cfg)
    _check_eval(cfg)

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
        _check_degrees(cfg.generator.parallelism, "generator.parallelism", world_size, exact=False)
    if cfg.weight_sync.transport == "server":
        check_serve(cfg)
    _check_degrees(cfg.trainer.parallelism, "trainer.parallelism", world_size, exact=True)

    if cfg.batch_invariant_mode:
        if cfg.model.dtype != "bfloat16":
            raise ValueError(
                f"batch_invariant_mode: needs model.dtype 'bfloat16', got '{cfg.model.dtype}'"
            )
        tp_t = cfg.trainer.parallelism.tensor_parallel_degree
        tp_g = cfg.generator.parallelism.tensor_parallel_degree
        if tp_t != 1 or tp_g != 1:
            # Row-parallel linears sum their shards in an all-reduce: DTensor's
            # NCCL one on the trainer, vLLM's own on the generator, in orders
            # nobody made equal.
            raise ValueError(
                "batch_invariant_mode: needs trainer.parallelism.tensor_parallel_degree and "
                f"generator.parallelism.tensor_parallel_degree 1, got {tp_t} and {tp_g} "
                "(a sharded matmul reduces in a different order)"
            )
        s = cfg.generator.sampling
        if s.top_p != 1.0 or s.top_k != -1:
            # vLLM reports logprobs of the top-p/top-k renormalised distribution,
            # which the trainer's recompute over the full vocabulary cannot equal.
            raise ValueError(
                f"batch_invariant_mode: needs generator.sampling.top_p 1 and top_k -1, "
                f"got {s.top_p} and {s.top_k}"
            )
        if cfg.model.lora.rank and cfg.model.lora.sync == "merged":
            raise ValueError(
                "batch_invariant_mode: needs model.lora.sync 'adapter' (merged W + BA cannot be "
                "bitwise equal to the trainer's unmerged forward)"
            )


def effective_task(cfg: JobConfig) -> str:
    """The task this run trains on: grpo.task, or grpo.task_without_checkpoint on random weights."""
    if cfg.model.hf_checkpoint is None and cfg.grpo.task_without_checkpoint is not None:
        return cfg.grpo.task_without_checkpoint
    return cfg.grpo.task


def tokenizer_dir(cfg: JobConfig) -> str | None:
    """The folder the run's task tokenizes with (and an export copies): task.tokenizer, else the checkpoint's."""
    return cfg.task.tokenizer or cfg.model.hf_checkpoint


def _check_grpo_variants(cfg: JobConfig) -> None:
    """Epochs, mini-batches, dynamic sampling, overlong handling and the entropy bonus (docs/design.md)."""
    _positive(cfg, "grpo.epochs", "grpo.mini_batches")
    _at_least(cfg, 0, "grpo.overlong_penalty", "grpo.entropy_coef", "metrics.samples_per_eval")
    if cfg.grpo.dynamic_sampling:
        _positive(cfg, "grpo.dynamic_sampling_max_rounds")
    if cfg.grpo.overlong == "soft_penalty" and not 0 < cfg.grpo.overlong_buffer <= cfg.generator.sampling.max_tokens:
        raise ValueError(f"grpo.overlong_buffer: must be in [1, generator.sampling.max_tokens "
                         f"{cfg.generator.sampling.max_tokens}], got {cfg.grpo.overlong_buffer}")


def _check_task(cfg: JobConfig) -> None:
    """The task section against grpo.task (the files are read when the task is built)."""
    task, name = cfg.task, effective_task(cfg).partition(":")[0]
    _at_least(cfg, 0, "task.format_reward_weight")
    _positive(cfg, "task.heldout_size")
    _in_range(cfg, "task.heldout_fraction", 0, 1, "[0, 1)")
    _positive(cfg, "task.max_turns")
    bad = [level for level in task.levels if not 1 <= level <= 5]
    if bad or not task.levels:
        raise ValueError(f"task.levels: each must be in 1..5, got {list(task.levels)}")
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
    _at_least(cfg, 0, "eval.every_n_steps", "eval.num_prompts", "eval.max_tokens", "eval.mean_at_k")
    if cfg.eval.max_tokens >= cfg.generator.max_model_len:
        raise ValueError(
            f"eval.max_tokens: {cfg.eval.max_tokens} leaves no room for a prompt in "
            f"generator.max_model_len {cfg.generator.max_model_len}"
        )
    if cfg.eval.every_n_steps and effective_task(cfg).partition(":")[0] == "digits":
        # Every digit string can be drawn for training: nothing is held out.
        raise ValueError("eval.every_n_steps: grpo.task 'digits' has no held-out set; use 'math' or 'dataset'")


SECRETS = {"serve.token": "TORCHTITAN_RL_SERVE_TOKEN", "serve.api_key": "TORCHTITAN_RL_API_KEY"}
"""Secret fields and the environment variables that may hold them; config.toml shows them as REDACTED."""
REDACTED = "<redacted>"


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
    for name in ("serve.port", "serve.sync_port"):
        if not 0 <= _get(cfg, name) <= 65535:
            raise ValueError(f"{name}: must be a TCP port in [0, 65535], got {_get(cfg, name)}")
    if cfg.serve.port == 0:
        raise ValueError("serve.port: must be set (the trainer and clients connect to it), got 0")
    if (cfg.serve.sync_port or cfg.serve.port + 1) in (cfg.serve.port, 65536):
        raise ValueError(f"serve.sync_port: {cfg.serve.sync_port or cfg.serve.port + 1} is not a free second port "
                         f"beside serve.port {cfg.serve.port}; set serve.sync_port")
    if not cfg.serve.token:
        raise ValueError("serve.token: set a shared secret (or TORCHTITAN_RL_SERVE_TOKEN); the trainer's control "
                         "requests and sync messages must carry it")
    if not cfg.serve.api_key and not _loopback(cfg.serve.host):
        raise ValueError(f"serve.api_key: required when serve.host ({cfg.serve.host}) is reachable beyond this "
                         "machine; set it (or TORCHTITAN_RL_API_KEY), or bind 127.0.0.1")
    _positive(cfg, "serve.max_body_mb", "serve.max_n", "serve.sync_timeout_s", "serve.max_concurrent_requests",
              "weight_sync.peer_timeout_s")
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


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def _check_own_rank_generator(cfg: JobConfig, world_size: int) -> None:
    """transport=nccl: trainer ranks + R generator replicas, one rank and one device each (generator/remote.py)."""
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
        # Not built: vLLM would need its TP group across our torchrun ranks (its CPU backend cannot: the engine
        # runs in this process), the torchtitan decoder inside vLLM a TP plan over that group (it is built
        # whole), and each rank's sync plan the slices of the trainer's tensors it holds (docs/scaling.md).
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


def _check_finite(cfg: Any, prefix: str = "") -> None:
    """Every float field (in a tuple too) of the tree is a finite number: NaN passes every `<` check."""
    for f in dataclasses.fields(cfg):
        value, path = getattr(cfg, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            _check_finite(value, path + ".")
            continue
        items = enumerate(value) if isinstance(value, tuple) else [(None, value)]
        for i, item in items:
            if isinstance(item, float) and not math.isfinite(item):
                where = path if i is None else f"{path}[{i}]"
                raise ValueError(f"{where}: must be a finite number, got {item}")


def _get(cfg: JobConfig, path: str) -> Any:
    obj: Any = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _positive(cfg: JobConfig, *paths: str) -> None:
    _at_least(cfg, 1, *paths)


def _positive_float(cfg: JobConfig, *paths: str) -> None:
    for path in paths:
        if not _get(cfg, path) > 0:
            raise ValueError(f"{path}: must be > 0, got {_get(cfg, path)}")


def _at_least(cfg: JobConfig, low: int, *paths: str) -> None:
    for path in paths:
        value = _get(cfg, path)
        if value < low:
            raise ValueError(f"{path}: must be >= {low}, got {value}")


def _in_range(cfg: JobConfig, path: str, low: float, high: float, text: str) -> None:
    value = _get(cfg, path)
    ok_low = value >= low if text[0] == "[" else value > low
    ok_high = value <= high if text[-1] == "]" else value < high
    if not (ok_low and ok_high):
        raise ValueError(f"{path}: must be in {text}, got {value}")


def _check_degrees(par: Any, path: str, world_size: int, *, exact: bool) -> None:
    """exact: shard * replicate * tp must equal world_size (trainer); else divide it."""
    shard = par.data_parallel_shard_degree
    rep, tp = par.data_parallel_replicate_degree, par.tensor_parallel_degree
    if shard != -1 and shard < 1:
        raise ValueError(
            f"{path}.data_parallel_shard_degree: must be -1 (infer) or >= 1, got {shard}"
        )
    for name, value in (("data_parallel_replicate_degree", rep), ("tensor_parallel_degree", tp)):
        if value < 1:
            raise ValueError(f"{path}.{name}: must be >= 1, got {value}")
    if shard == -1 or not exact:
        used = rep * tp * max(shard, 1)
        if world_size % used:
            raise ValueError(
                f"{path}: degrees multiply to {used}, which does not divide world size {world_size}"
            )
    elif shard * rep * tp != world_size:
        raise ValueError(
            f"{path}: data_parallel_shard_degree ({shard}) * data_parallel_replicate_degree "
            f"({rep}) * tensor_parallel_degree ({tp}) = {shard * rep * tp} "
            f"!= world size {world_size}"
        )


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """The CLI boundary: --config FILE.toml, then --section.field overrides, then validate.

    World size for validation comes from $WORLD_SIZE (torchrun), default 1.
    On bad input prints one line "config error: ..." to stderr and exits 2.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        config_path, rest = _split_config_arg(argv)
        default = load_toml(config_path) if config_path else JobConfig()
        rest = _normalize_bool_args(rest)
        cfg = _tyro_cli(default, rest)
        validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as e:
        if os.environ.get("RANK", "0") == "0":  # every torchrun rank parses the same argv: one line, not one a rank
            print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return cfg


def _split_config_arg(argv: list[str]) -> tuple[str | None, list[str]]:
    path, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or arg.startswith("--config="):
            if path is not None:
                raise ValueError("--config: given more than once")
            if "=" in arg:
                path = arg.split("=", 1)[1]
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                path, i = argv[i + 1], i + 1
            else:
                raise ValueError("--config: expected a path to a TOML file")
        else:
            rest.append(arg)
        i += 1
    return path, rest


def _leaf_types(cls: type = JobConfig, prefix: str = "") -> dict[str, Any]:
    """Dotted field path -> type, for every non-dataclass field."""
    out = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type):
            out |= _leaf_types(f.type, f"{prefix}{f.name}.")
        else:
            out[prefix + f.name] = f.type
    return out


def _normalize_bool_args(args: list[str]) -> list[str]:
    """Accept --flag true/false (and --flag=false) besides tyro's --flag / --no-flag."""
    bools = {p for p, t in _leaf_types().items() if t is bool}
    out, i = [], 0
    while i < len(args):
        key, eq, value = args[i].partition("=")
        path = key[2:].replace("-", "_") if key.startswith("--") else None
        if path not in bools:
            out.append(args[i])
            i += 1
            continue
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, eq, i = args[i + 1], "=", i + 1
        if eq:
            if value.lower() not in ("true", "false"):
                raise ValueError(f"{path}: expected true or false, got {value!r}")
            if value.lower() == "false":
                head, _, name = path.rpartition(".")
                path = f"{head}.no_{name}" if head else f"no_{name}"
        out.append(f"--{path}")
        i += 1
    return out


class _TyroError(Exception):
    pass


def _tyro_cli(default: JobConfig, args: list[str]) -> JobConfig:
    """tyro.cli with its multi-line error box turned into one ValueError line."""
    import tyro

    try:
        from tyro import _errors  # private hook API (tyro >= 1.0); else we parse the box
    except ImportError:  # pragma: no cover
        _errors = None

    def hook(event: Any) -> None:
        raise _TyroError(_describe_tyro_event(event))

    stderr = io.StringIO()
    hooked = _errors.on_parse_error(hook) if _errors else contextlib.nullcontext()
    try:
        with hooked, contextlib.redirect_stderr(stderr):
            cfg = tyro.cli(
                JobConfig, default=default, args=args, prog=_prog(), description=_DESCRIPTION
            )
    except _TyroError as e:
        raise ValueError(str(e)) from None
    except SystemExit as e:
        if e.code in (0, None):
            raise
        raise ValueError(_flatten_box(stderr.getvalue()) or f"invalid arguments: {args}") from None
    sys.stderr.write(stderr.getvalue())  # warnings, if any
    return cfg


def _prog() -> str:
    argv0 = sys.argv[0]
    if argv0.endswith("simple_grpo.py"):
        return "python -m torchtitan_rl.simple_grpo"
    return os.path.basename(argv0) or "torchtitan-rl-grpo"


def _describe_tyro_event(event: Any) -> str:
    kind = type(event).__name__
    arg = getattr(event, "argument", None)
    path = arg.lowered.name_or_flags[0].lstrip("-").replace("-", "_") if arg else None
    if kind == "UnrecognizedArgs":
        flags = [t for t in event.tokens if t.startswith("--")]
        token = (flags or event.tokens)[0]
        msg = f"unrecognized argument '{token}'"
        if flags:
            name = token.partition("=")[0].lstrip("-").replace("-", "_")
            close = difflib.get_close_matches(name, list(_leaf_types()), n=1, cutoff=0.6)
            if close:
                msg += f" (did you mean '--{close[0]}'?)"
        return msg
    if kind == "InvalidChoice":
        choices = ", ".join(repr(c) for c in event.choices)
        return f"{path}: expected one of {choices}, got {event.value!r}"
    if kind == "BadValue":
        nargs = arg.lowered.nargs if isinstance(arg.lowered.nargs, int) else 1
        return f"{path}: expected {nargs} value{'s' if nargs > 1 else ''}"
    if kind == "InstantiationFailure" and path:
        return f"{path}: {event.message}"
    if hasattr(event, "message"):
        return str(event.message)
    return kind


def _flatten_box(text: str) -> str:
    """'Title: message' from a tyro error box, without the box drawing."""
    lines = [" ".join(re.sub(r"[\u2500-\u257f]", " ", line).split()) for line in text.splitlines()]
    lines = lines[lines.index(next(filter(None, lines), "")):]  # drop leading blanks
    if not lines:
        return ""
    body = []
    for line in lines[1:]:
        if not line:  # a horizontal rule ends the message
            break
        body.append(line)
    return f"{lines[0]}: {' '.join(body)}"


def config_diff(old: JobConfig, new: JobConfig) -> list[tuple[str, Any, Any]]:
    """(field.path, old value, new value) of every leaf field that differs, in the tree's order."""
    return [(path, _get(old, path), _get(new, path)) for path in _leaf_types()
            if _get(old, path) != _get(new, path)]
