"""The task interface: where prompts come from and how completions are scored.

A task is the one plug-in point for a user's RL problem. The trainer and the
generator only ever see token ids; the task owns the tokenizer that makes
them, samples prompts, and turns a completion into a scalar reward. A task
may also hold out a fixed set of prompts for evaluation, and may keep state
of its own (a dataset's place in its epoch) that checkpoints save.
"""

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass
class Prompt:
    """One prompt as the generator receives it, plus what the reward needs."""

    token_ids: list[int]
    """The prompt's tokens, specials (e.g. <bos>) included: fed to vLLM as-is."""
    text: str
    """Human-readable form of token_ids, for logs."""
    target: Any
    """Task-specific ground truth the reward compares against."""
    level: int | None = None
    """Difficulty level, where the task has levels (math): rewards are also reported per level."""


class Task(ABC):
    """A prompt source plus a verifiable reward.

    Subclasses set ``tokenizer``, ``eos_id`` and ``pad_id`` in ``__init__``.
    ``vocab_size`` defaults to the tokenizer's largest id + 1.
    """

    tokenizer: Any
    """A ``tokenizers.Tokenizer`` or a transformers tokenizer: makes prompts, reads completions,
    sizes the tiny model's vocab."""
    eos_id: int
    """Token that ends a completion; generation stops on it."""
    pad_id: int
    """Token used to pad ragged batches; never scored."""
    chat_template: str | None = None
    """A task with its own ``tokenizers.Tokenizer``: the Jinja chat template its run's export carries, so that
    chat front ends (vLLM's ``LLM.chat``) render messages as the task's prompts; none: the export has none."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model must cover (both tokenizer kinds have get_vocab)."""
        return max(self.tokenizer.get_vocab().values()) + 1

    @abstractmethod
    def sample_prompts(self, n: int, *, generator: random.Random) -> list[Prompt]:
        """Draw ``n`` prompts; all randomness comes from ``generator`` (reproducible runs)."""

    def sample_extra_prompts(self, n: int, *, generator: random.Random) -> list[Prompt]:
        """Draw ``n`` prompts outside the main stream (dynamic sampling's refills): the state that
        ``state_dict`` saves must not move. The built-in stateless tasks draw as ``sample_prompts``."""
        assert not self.state_dict(), f"{type(self).__name__} keeps prompt state: override sample_extra_prompts"
        return self.sample_prompts(n, generator=generator)

    @abstractmethod
    def reward(self, prompt: Prompt, completion_ids: list[int]) -> float:
        """Score one completion, higher is better (the built-in tasks: [0, 1], plus an optional
        format bonus); ``completion_ids`` may end with ``eos_id``."""

    @abstractmethod
    def describe(self, prompt: Prompt, completion_ids: list[int]) -> str:
        """One human-readable line (prompt, completion, target, reward) for logs."""

    def completion_text(self, completion_ids: list[int]) -> str:
        """What the model answered, for logs and samples (special tokens dropped)."""
        return self.tokenizer.decode(completion_ids, skip_special_tokens=True)

    def correct(self, prompt: Prompt, completion_ids: list[int]) -> bool:
        """Whether the completion solves the prompt: held-out accuracy counts these."""
        return self.reward(prompt, completion_ids) >= 1.0

    def submit(self, generator, prompts: list[Prompt], *, n: int, seed: int | None, sampling,
               max_total_tokens: int, lengths=None):
        """Ask ``generator`` (any layout, rollout/base.py) for ``n`` completions per prompt, group-contiguous,
        one turn each, ending at ``eos_id``; returns its Pending. Multi-turn tasks (tasks/episodes.py) play
        whole episodes here. ``lengths``: the timing harness's (grpo.harness_lengths, Engine.generate), passed
        on only when set."""
        drawn = {} if lengths is None else {"lengths": lengths}
        return generator.submit([p.token_ids for p in prompts], n=n, stop_token_ids=[self.eos_id], seed=seed,
                                sampling=sampling, **drawn)

    def rollouts(self, generator, prompts: list[Prompt], **kwargs):
        """``submit(...).result()``: ask and wait."""
        return self.submit(generator, prompts, **kwargs).result()

    def heldout_prompts(self) -> list[Prompt]:
        """A fixed set of prompts never drawn by ``sample_prompts``; empty: nothing held out."""
        return []

    def state_dict(self) -> dict:
        """State ``sample_prompts`` keeps besides its ``generator`` (saved in checkpoints)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned, so a resumed run draws the same prompts."""
        if state:
            raise ValueError(f"grpo.task: the checkpoint holds another task's prompt state ({sorted(state)})")
