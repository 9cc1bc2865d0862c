"""Verifiable rewards for answers in text: math-verify for correctness, a \\boxed{} format check.

A reward function takes a completion's text (decoded, special tokens
skipped) and the reference answer, and returns a float. Tasks hold a list of
``(weight, function)`` pairs, so a user's task can mix in its own.

math-verify (HF's) extracts the final answer (``\\boxed{...}`` first, else the
last number or expression) and compares it with the reference symbolically,
so ``\\boxed{1,234}``, ``1234.0`` and ``The answer is 1234`` all match 1234.
Symbolic equality also accepts an unevaluated expression: ``38 + 81 = 38 + 81``
"equals" 119. Where the reference is a number, ``numeric_answer = "number"``
(the default of every task and named set) wants the final answer to be a number
itself, so a policy cannot score by writing the sum and stopping; ``"expression"``
keeps math-verify's symbolic equality.
Its time limits are SIGALRM alarms, which only the main thread may set: the
loop scores in the main thread; elsewhere the limits are switched off.
"""

import functools
import threading
from typing import Callable, Literal

import sympy
from math_verify import parse, verify

RewardFn = Callable[[str, str], float]
"""(completion text, reference answer) -> reward."""

NumericAnswer = Literal["number", "expression"]
"""task.numeric_answer, eval.sets[i].numeric_answer (config/job_config.py says what each accepts)."""

TIMEOUT_S = 5
"""Longest math-verify may spend parsing or comparing one answer (main thread only)."""


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=65536)
def _parse_reference(answer: str):
    # A reference is an answer, not prose: read it as one math expression.
    # Cached: every completion of a group is compared with the same reference.
    return parse(f"${answer}$", parsing_timeout=_timeout())


def is_number(parsed: list) -> bool:
    """Whether math-verify's parse of an answer is a number as written, not an expression to evaluate: a sympy
    Number (integer, decimal, fraction), or a number with a percent sign."""
    if not parsed or not isinstance(parsed[0], sympy.Basic):
        return False
    value = parsed[0]
    percent = sympy.UnevaluatedExpr(sympy.Rational(1, 100))  # how math-verify reads "%"
    if isinstance(value, sympy.Mul) and len(value.args) == 2 and percent in value.args:
        value = next(a for a in value.args if a != percent)
    return isinstance(value, sympy.Number)


@functools.lru_cache(maxsize=8192)
def correct(text: str, answer: str, numeric_answer: NumericAnswer = "number") -> float:
    """1.0 when the completion's final answer equals the reference, else 0.0; ``numeric_answer``: whether a
    numeric reference wants a number ("number") or any expression equal to it ("expression").

    Cached: a step reads each completion twice (its reward, and its verdict for dynamic sampling)."""
    gold = _parse_reference(answer)
    assert gold, f"reference answer {answer!r} does not parse"
    predicted = parse(text, parsing_timeout=_timeout())
    if numeric_answer == "number" and is_number(gold) and not is_number(predicted):
        return 0.0
    return float(bool(predicted) and verify(gold, predicted, timeout_seconds=_timeout()))


CORRECT: dict[str, RewardFn] = {
    "number": correct, "expression": functools.partial(correct, numeric_answer="expression"),
}
"""numeric_answer -> the correctness reward (text, answer) -> 0.0 or 1.0."""


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


def reward_fns(format_weight: float, numeric_answer: NumericAnswer = "number") -> list[tuple[float, RewardFn]]:
    """The math tasks' default: correctness (as ``correct`` with ``numeric_answer``), plus the format reward
    when its weight is > 0."""
    fns: list[tuple[float, RewardFn]] = [(1.0, CORRECT[numeric_answer])]
    if format_weight > 0:
        fns.append((format_weight, boxed_format))
    return fns
