"""GRPO algorithm pieces: tasks (prompts + rewards), advantages, and the loss.

Pure torch + tokenizers, nothing that knows about vLLM or torchtitan; except builder.py, which
turns a step's rollouts into the Trainer's batch (steps 3-5 of the loop).
"""

from torchtitan_rl.grpo.advantages import group_advantages
from torchtitan_rl.grpo.loss import grpo_loss
from torchtitan_rl.grpo.tasks import DigitsTask, Prompt, Task, build_digits_tokenizer, build_task

__all__ = [
    "DigitsTask",
    "Prompt",
    "Task",
    "build_digits_tokenizer",
    "build_task",
    "group_advantages",
    "grpo_loss",
]
