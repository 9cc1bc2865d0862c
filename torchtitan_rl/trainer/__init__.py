"""The torchtitan trainer: torchtitan's decoder (Qwen3 or Llama family) under FSDP2, GRPO steps, DCP checkpoints."""

from torchtitan_rl.trainer.trainer import TrainBatch, Trainer

__all__ = ["TrainBatch", "Trainer"]
