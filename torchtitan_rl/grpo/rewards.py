"""Verifiable rewards for answers in text: math-verify for correctness, a \\boxed{} format check.

A reward function takes a completion's text (decoded, special tokens
skipped) and the reference answer, and returns a float. Tasks hold a list of
``(weight, function)`` pairs, so a user's task can mix in its own.

math-verify (HF's) extracts the final answer (``\\boxed{...}`` first, else the
last number or expression) and compares it with the reference symbolically,
so ``\\boxed{1,234}``, ``1234.0`` and ``The answer is 1234`` all match 1234.
Its time limits are SIGALRM alarms, which only the main thread may set: the
loop scores in the main thread; elsewhere the limits are switched off.
"""

import functools
import threading
from typing import Callable

from math_verify import parse, verify

RewardFn = Callable[[str, str], float]
"""(completion text, reference answer) -> reward."""

TIMEOUT_S = 5
"""Longest math-verify may spend parsing or comparing one answer (main thread only)."""


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=65536)
def _parse_reference(answer: str):
    # A reference is an answer, not prose: read it as one math expression.
    # Cached: every completion of a group is compared with the same reference.
    return parse(f"${answer}$", parsing_timeout=_timeout())


@functools.lru_cache(maxsize=8192)
def correct(text: str, answer: str) -> float:
    """1.0 when the completion's final answer equals the reference, else 0.0.

    Cached: a step reads each completion twice (its reward, and its verdict for dynamic sampling)."""
    gold = _parse_reference(answer)
    assert gold, f"reference answer {answer!r} does not parse"
    predicted = parse(text, parsing_timeout=_timeout())
    return float(bool(predicted) and verify(gold, predicted, timeout_seconds=_timeout()))


def boxed_format(text: str, answer: str) -> float:
    """1.0 when the completion states an answer as \\boxed{...} with something inside, else 0.0."""
    del answer  # format only: right or wrong alike
    return float(bool(boxed_contents(text)))


def boxed_contents(text: str) -> list[str]:
    """The non-empty contents of every \\boxed{...}, nested braces included."""
    found, start = [], 0
    while (i := text.find("\\boxed{", start)) != -1:
        depth, j = 1, i + len("\\boxed{")
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth == 0 and text[i + len("\\boxed{") : j - 1].strip():
            found.append(text[i + len("\\boxed{") : j - 1].strip())
        start = j
    return found


def reward_fns(format_weight: float) -> list[tuple[float, RewardFn]]:
    """The math tasks' default: correctness, plus the format reward when its weight is > 0."""
    fns: list[tuple[float, RewardFn]] = [(1.0, correct)]
    if format_weight > 0:
        fns.append((format_weight, boxed_format))
    return fns
