"""The typed run config: one JobConfig tree from TOML + command line."""

from torchtitan_rl.config.job_config import (
    CheckpointConfig,
    GeneratorConfig,
    GRPOConfig,
    JobConfig,
    JobSection,
    LoRAConfig,
    LRSchedulerConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    SamplingConfig,
    TrainerConfig,
    WeightSyncConfig,
)
from torchtitan_rl.config.loader import (
    from_dict,
    load_toml,
    parse_args,
    to_toml,
    validate,
    write_toml,
)

__all__ = [
    "CheckpointConfig",
    "GeneratorConfig",
    "GRPOConfig",
    "JobConfig",
    "JobSection",
    "LoRAConfig",
    "LRSchedulerConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "SamplingConfig",
    "TrainerConfig",
    "WeightSyncConfig",
    "from_dict",
    "load_toml",
    "parse_args",
    "to_toml",
    "validate",
    "write_toml",
]
