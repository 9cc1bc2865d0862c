"""JobConfig from TOML and command line, in process: precedence, round trip, run_configs."""

import dataclasses
import functools
import re
import tomllib
import types
import typing
from pathlib import Path

import pytest

from torchtitan_rl.config import (
    JobConfig,
    from_dict,
    load_toml,
    parse_args,
    to_toml,
    validate,
    write_toml,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_defaults_are_valid_and_generator_keeps_its_own_parallelism_default():
    cfg = parse_args([])
    assert cfg == JobConfig()
    validate(cfg)
    assert cfg.trainer.parallelism.data_parallel_shard_degree == -1
    assert cfg.generator.parallelism.data_parallel_shard_degree == 1


def test_expert_parallel_degree_is_checked_against_the_ranks_next_to_the_field():
    cfg = JobConfig()
    cfg.trainer.parallelism.expert_parallel_degree = 2
    validate(cfg, world_size=4)  # FSDP over 4: 2 ranks place the experts, 2 shard them
    with pytest.raises(ValueError, match=r"^trainer\.parallelism\.expert_parallel_degree: 2 does not divide "
                                         r"data_parallel_shard_degree x tensor_parallel_degree = 3$"):
        validate(cfg, world_size=3)
    cfg = JobConfig()
    cfg.generator.parallelism.expert_parallel_degree = 2
    with pytest.raises(ValueError, match=r"^generator\.parallelism\.expert_parallel_degree: each engine holds"):
        validate(cfg)


@pytest.mark.parametrize("fields, message", [
    ({"grpo.epochs": 2}, "grpo.old_logprobs: 'train' needs one optimizer step per batch (grpo.epochs and "
                         "grpo.mini_batches 1, got 2 and 1)"),
    ({"batch_invariant_mode": True}, "batch_invariant_mode: needs grpo.old_logprobs 'recompute'"),
    ({"generator.stream_groups": True, "weight_sync.transport": "nccl"},
     "generator.stream_groups: overlaps the recompute of pi_old"),
], ids=["epochs", "batch-invariant", "streaming"])
def test_pi_old_from_the_training_forward_is_refused_where_it_would_be_wrong(fields, message):
    cfg = load_toml(REPO / "run_configs" / "cpu_tiny.toml")
    cfg.grpo.old_logprobs = "train"
    validate(cfg)  # one optimizer step, no correction: fine
    for path, value in fields.items():
        *sections, name = path.split(".")
        setattr(functools.reduce(getattr, sections, cfg), name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(cfg, world_size=2)


@pytest.mark.parametrize("name", ["cpu_tiny", "qwen3_0.6b", "qwen3_0.6b_long_tail", "qwen3_1.7b_long_tail"])
def test_run_configs_load_strictly_and_validate(name):
    cfg = load_toml(REPO / "run_configs" / f"{name}.toml")
    validate(cfg)
    assert cfg.job.output_dir == f"outputs/{name}"


def test_run_config_values():
    tiny = load_toml(REPO / "run_configs/cpu_tiny.toml")
    assert (tiny.model.flavor, tiny.job.device) == ("tiny", "cpu")
    qwen = load_toml(REPO / "run_configs/qwen3_0.6b.toml")
    assert (qwen.model.flavor, qwen.job.device) == ("0.6B", "cuda")
    assert qwen.generator.enforce_eager is False
    assert qwen.generator.max_model_len == 1024
    assert qwen.generator.sampling.max_tokens == 256
    assert qwen.trainer.checkpoint.enable is True


def test_cli_beats_file_beats_default(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        "batch_invariant_mode = false\n"
        "[trainer.optimizer]\nlr = 1e-3\nbetas = [0.8, 0.9]\nweight_decay = 0.1\n"
        "[trainer.lr_scheduler]\ndecay = 'linear'\n"
        "[generator.sampling]\ntemperature = 0.5\nmax_tokens = 6\n"
        "[weight_sync]\nenable = true\n"
    )
    cfg = parse_args(
        [
            "--config", str(path),
            "--trainer.optimizer.lr", "1e-4",
            "--trainer.optimizer.betas", "0.5", "0.6",
            "--trainer.lr_scheduler.decay", "cosine",
            "--generator.sampling.temperature", "0.7",
            "--batch-invariant-mode",
            "--weight_sync.enable", "false",
        ]
    )  # fmt: skip
    assert cfg.trainer.optimizer.lr == 1e-4  # nested 3 levels, float
    assert cfg.trainer.optimizer.betas == (0.5, 0.6)  # tuple stays a tuple
    assert cfg.trainer.lr_scheduler.decay == "cosine"  # Literal
    assert cfg.generator.sampling.temperature == 0.7
    assert cfg.batch_invariant_mode is True  # bool flag
    assert cfg.weight_sync.enable is False  # bool with a value
    assert cfg.trainer.optimizer.weight_decay == 0.1  # file only
    assert cfg.generator.sampling.max_tokens == 6  # file only
    assert cfg.trainer.optimizer.eps == 1e-8  # default
    assert cfg.trainer.steps == 40  # default


def test_cli_accepts_dashes_underscores_and_equals():
    a = parse_args(["--trainer.micro-batch-size", "4", "--generator.sampling.max_tokens=9"])
    assert (a.trainer.micro_batch_size, a.generator.sampling.max_tokens) == (4, 9)
    b = parse_args(["--batch_invariant_mode=true", "--trainer.checkpoint.no-enable"])
    assert b.batch_invariant_mode is True and b.trainer.checkpoint.enable is False


def test_cli_can_set_and_clear_an_optional_field(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[model]\nhf_checkpoint = '/weights/qwen'\n")
    assert parse_args(["--config", str(path)]).model.hf_checkpoint == "/weights/qwen"
    cleared = parse_args(["--config", str(path), "--model.hf-checkpoint", "None"])
    assert cleared.model.hf_checkpoint is None


def test_toml_int_is_accepted_for_float():
    cfg = from_dict({"trainer": {"optimizer": {"lr": 1}}})
    assert cfg.trainer.optimizer.lr == 1.0 and type(cfg.trainer.optimizer.lr) is float


def test_toml_section_keeps_its_parents_default():
    cfg = from_dict({"generator": {"parallelism": {"tensor_parallel_degree": 1}}})
    assert cfg.generator.parallelism.data_parallel_shard_degree == 1


@pytest.mark.parametrize("hf_checkpoint", [None, 'C:\\weights "q"\n'])
def test_to_toml_round_trips(tmp_path, hf_checkpoint):
    cfg = JobConfig()
    cfg.model.hf_checkpoint = hf_checkpoint
    cfg.trainer.optimizer.betas = (0.5, 0.999)
    cfg.trainer.optimizer.lr = 1e-6
    cfg.generator.sampling.top_p = 0.95
    cfg.batch_invariant_mode = True
    assert from_dict(tomllib.loads(to_toml(cfg))) == cfg
    write_toml(cfg, tmp_path / "out" / "config.toml")
    back = load_toml(tmp_path / "out" / "config.toml")
    assert back == cfg
    assert type(back.trainer.optimizer.betas) is tuple


def _optional_fields(cls=JobConfig, prefix=""):
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type):
            yield from _optional_fields(f.type, f"{prefix}{f.name}.")
        elif typing.get_origin(f.type) in (typing.Union, types.UnionType):
            yield prefix + f.name, f.default


def test_every_optional_field_defaults_to_none_so_toml_can_omit_it():
    fields = dict(_optional_fields())
    assert "model.hf_checkpoint" in fields
    assert all(default is None for default in fields.values()), fields
