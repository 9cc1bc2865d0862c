"""The task interface: where prompts come from and how completions are scored.

A task is the one plug-in point for a user's RL problem. The trainer and the
generator only ever see token ids; the task owns the tokenizer that makes
them, samples prompts, and turns a completion into a scalar reward.
"""

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer


@dataclass
class Prompt:
    """One prompt as the generator receives it, plus what the reward needs."""

    token_ids: list[int]
    """The prompt's tokens, specials (e.g. <bos>) included: fed to vLLM as-is."""
    text: str
    """Human-readable form of token_ids, for logs."""
    target: Any
    """Task-specific ground truth the reward compares against."""


class Task(ABC):
    """A prompt source plus a verifiable reward.

    Subclasses set ``tokenizer``, ``eos_id`` and ``pad_id`` in ``__init__``.
    ``vocab_size`` defaults to the tokenizer's; override it when the model's
    embedding table must be larger than the tokenizer (e.g. padded vocabs).
    """

    tokenizer: Tokenizer
    """Tokenizer for prompts and completions (also sizes the tiny model's vocab)."""
    eos_id: int
    """Token that ends a completion; generation stops on it."""
    pad_id: int
    """Token used to pad ragged batches; never scored."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model must cover."""
        return self.tokenizer.get_vocab_size()

    @abstractmethod
    def sample_prompts(self, n: int, *, generator: random.Random) -> list[Prompt]:
        """Draw ``n`` prompts; all randomness comes from ``generator`` (reproducible runs)."""

    @abstractmethod
    def reward(self, prompt: Prompt, completion_ids: list[int]) -> float:
        """Score one completion in [0, 1]; ``completion_ids`` may end with ``eos_id``."""

    @abstractmethod
    def describe(self, prompt: Prompt, completion_ids: list[int]) -> str:
        """One human-readable line (prompt, completion, target, reward) for logs."""
