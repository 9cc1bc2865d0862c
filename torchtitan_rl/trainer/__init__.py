"""The torchtitan trainer: Qwen3 under FSDP2, GRPO steps, DCP checkpoints."""

from torchtitan_rl.trainer.trainer import TrainBatch, Trainer

__all__ = ["TrainBatch", "Trainer"]
