"""The typed run config: one JobConfig tree from TOML + command line.

job_config.py: the sections, each checking its own fields; toml_io.py: TOML in and out;
validation.py: checks across sections; cli.py: the command line (tyro).
"""

from torchtitan_rl.config.job_config import (
    CheckpointConfig,
    EvalConfig,
    EvalSetConfig,
    GeneratorConfig,
    GRPOConfig,
    HarnessLengthsConfig,
    JobConfig,
    JobSection,
    LoRAConfig,
    LRSchedulerConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    PartialRolloutConfig,
    SamplingConfig,
    ServeConfig,
    TaskConfig,
    TrainerConfig,
    WandbConfig,
    WeightSyncConfig,
)
from torchtitan_rl.config.cli import parse_args
from torchtitan_rl.config.toml_io import from_dict, load_toml, to_toml, write_toml
from torchtitan_rl.config.validation import validate

__all__ = [
    "CheckpointConfig",
    "EvalConfig",
    "EvalSetConfig",
    "GeneratorConfig",
    "GRPOConfig",
    "HarnessLengthsConfig",
    "JobConfig",
    "JobSection",
    "LoRAConfig",
    "LRSchedulerConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "PartialRolloutConfig",
    "SamplingConfig",
    "ServeConfig",
    "TaskConfig",
    "TrainerConfig",
    "WandbConfig",
    "WeightSyncConfig",
    "from_dict",
    "load_toml",
    "parse_args",
    "to_toml",
    "validate",
    "write_toml",
]
