"""Tasks: prompt sources plus verifiable rewards (the user plug-in point)."""

from torchtitan_rl.grpo.tasks.base import Prompt, Task
from torchtitan_rl.grpo.tasks.digits import DigitsTask, build_digits_tokenizer
from torchtitan_rl.grpo.tasks.registry import build_task, check_vocabulary

__all__ = ["DigitsTask", "Prompt", "Task", "build_digits_tokenizer", "build_task", "check_vocabulary"]
