"""grpo.task = "math": seeded arithmetic word problems of graded difficulty, no download.

Five levels, each a few story templates with random names, objects and
numbers (answers are whole numbers >= 0; every division is exact):

    1  one + or -, numbers up to 20          "Mia has 7 shells and finds 5 more. ..."
    2  one * or exact /, factors up to 10     "24 stickers are shared equally among 6 friends. ..."
    3  two steps, + - *, numbers up to 20     "3 boxes of 4 pens, and 5 pens already. ..."
    4  two steps with / or larger numbers     "earns 12 dollars an hour for 6 hours, spends 30. ..."
    5  three steps mixing all four            "buys 4 packs of 6, gives away 3, shares the rest among 3. ..."

Levels 1-2 are within reach of a 135M instruct model from the start, so
GRPO has signal in every batch; 3-5 leave room to improve.

Train and held-out never overlap: a problem belongs to the held-out side iff
a hash of its text falls in one bucket of ``HELDOUT_BUCKETS``. The held-out
set is the first ``heldout_size`` such problems drawn with a fixed seed
(task.levels in turn: each listed level equally often); the training stream
draws from the run's prompt RNG and skips every held-out-side problem.
"""

import dataclasses
import random
from dataclasses import dataclass

from torchtitan_rl.config import TaskConfig
from torchtitan_rl.grpo.tasks.base import Prompt
from torchtitan_rl.grpo.tasks.chat import ChatTask, stable_hash

HELDOUT_BUCKETS = 16
"""1 in 16 possible problems is held-out-side (level 1 has a few thousand distinct texts)."""
HELDOUT_SEED = 20_240_601
"""The held-out set is the same for every run (and job.seed)."""
LEVELS = (1, 2, 3, 4, 5)

NAMES = ["Mia", "Leo", "Ava", "Sam", "Noah", "Zoe", "Omar", "Lena", "Ravi", "Kira", "Tom", "Ines"]
ITEMS = ["apples", "marbles", "stickers", "pencils", "shells", "cookies", "cards", "stamps", "books", "coins"]
CONTAINERS = ["boxes", "bags", "packs", "jars", "crates"]


@dataclass(frozen=True)
class Problem:
    text: str
    answer: int
    level: int
    steps: int
    """Arithmetic operations needed (the difficulty the level stands for)."""


def make_problem(level: int, rng: random.Random) -> Problem:
    """One problem of ``level``; all randomness from ``rng``."""
    name, other = rng.sample(NAMES, 2)
    item, box = rng.choice(ITEMS), rng.choice(CONTAINERS)
    r = rng.randint
    template = rng.randrange(3)
    if level == 1:
        a, b = r(2, 20), r(2, 20)
        if template == 0:
            return Problem(f"What is {a} + {b}?", a + b, 1, 1)
        if template == 1:
            return Problem(f"{name} has {a} {item} and finds {b} more. How many {item} does {name} have now?",
                           a + b, 1, 1)
        a, b = max(a, b), min(a, b)
        return Problem(f"{name} has {a} {item} and gives {b} of them to {other}. "
                       f"How many {item} does {name} have left?", a - b, 1, 1)
    if level == 2:
        a, b = r(2, 10), r(2, 10)
        if template == 0:
            return Problem(f"What is {a} times {b}?", a * b, 2, 1)
        if template == 1:
            return Problem(f"{name} buys {a} {box} with {b} {item} in each. How many {item} does {name} buy?",
                           a * b, 2, 1)
        return Problem(f"{a * b} {item} are shared equally among {b} friends. "
                       f"How many {item} does each friend get?", a, 2, 1)
    if level == 3:
        a, b, c = r(2, 10), r(2, 10), r(2, 20)
        if template == 0:
            return Problem(f"{name} has {c} {item} and buys {a} {box} with {b} {item} in each. "
                           f"How many {item} does {name} have now?", a * b + c, 3, 2)
        if template == 1:
            c = r(1, a * b - 1)
            return Problem(f"A shop has {a} {box} of {item} with {b} in each. It sells {c} {item}. "
                           f"How many {item} are left?", a * b - c, 3, 2)
        a, b, c = r(10, 20), r(2, 9), r(2, 20)
        return Problem(f"{name} has {a} {item}, gives {b} to {other}, then finds {c} more. "
                       f"How many {item} does {name} have now?", a - b + c, 3, 2)
    if level == 4:
        if template == 0:
            a, b = r(5, 20), r(2, 9)
            c = r(1, a * b - 1)
            return Problem(f"{name} earns {a} dollars an hour and works {b} hours. {name} then spends {c} dollars. "
                           f"How many dollars does {name} have left?", a * b - c, 4, 2)
        k, q, c = r(2, 9), r(2, 12), r(2, 15)
        if template == 1:
            return Problem(f"{name} shares {k * q} {item} equally among {k} friends, and then each friend "
                           f"gets {c} more from {other}. How many {item} does each friend have?", q + c, 4, 2)
        return Problem(f"{k * q} students are split into groups of {k}. Each group gets {c} {item}. "
                       f"How many {item} are handed out?", q * c, 4, 2)
    assert level == 5, level
    a, b, k = r(3, 9), r(3, 9), r(2, 6)
    if template == 0:
        q = r(1, (a * b - 1) // k)  # a * b >= 9 > k: at least one exact share
        c = a * b - k * q
        return Problem(f"{name} buys {a} {box} with {b} {item} in each, gives {c} {item} to {other}, "
                       f"and shares the rest equally among {k} friends. How many {item} does each friend get?",
                       q, 5, 3)
    if template == 1:
        c, d = r(1, a * b - 1), r(2, 20)
        return Problem(f"A farmer has {a} rows of {b} plants. {c} plants die, and the farmer plants {d} new ones. "
                       f"How many plants are there now?", a * b - c + d, 5, 3)
    c = 2 * r(1, a * b - 1)  # even, so half of what is left is whole
    return Problem(f"{name} earns {2 * a} dollars a day for {b} days and spends {c} dollars. "
                   f"{name} saves half of what is left. How many dollars does {name} save?",
                   (2 * a * b - c) // 2, 5, 3)


def is_heldout(text: str) -> bool:
    """Which side of the split a problem text is on (a stable hash, not Python's salted one)."""
    return stable_hash(text) % HELDOUT_BUCKETS == 0


def heldout_problems(levels: tuple[int, ...], size: int) -> list[Problem]:
    """The fixed held-out set: ``size`` distinct held-out-side problems, levels in turn."""
    rng, seen, out = random.Random(HELDOUT_SEED), set(), []
    while len(out) < size:
        problem = make_problem(levels[len(out) % len(levels)], rng)
        if is_heldout(problem.text) and problem.text not in seen:
            seen.add(problem.text)
            out.append(problem)
    return out


def train_problem(levels: tuple[int, ...], rng: random.Random) -> Problem:
    """One training problem: a uniformly drawn level, never a held-out-side text."""
    level = rng.choice(levels)
    while True:
        problem = make_problem(level, rng)
        if not is_heldout(problem.text):
            return problem


class MathTask(ChatTask):
    """Arithmetic word problems in the model's chat template; reward: the answer, checked by math-verify."""

    def __init__(self, config: TaskConfig, *, tokenizer_dir: str, field: str = "task.tokenizer", **kwargs) -> None:
        super().__init__(config, tokenizer_dir=tokenizer_dir, field=field, **kwargs)
        self.levels = tuple(config.levels)  # a repeated level is drawn more often
        self._heldout = [self._prompt(p) for p in heldout_problems(self.levels, config.heldout_size)]

    def sample_prompts(self, n: int, *, generator: random.Random) -> list[Prompt]:
        problems = [train_problem(self.levels, generator) for _ in range(n)]
        return [self._prompt(p) for p in problems]

    def _prompt(self, problem: Problem) -> Prompt:
        return dataclasses.replace(self.make_prompt(problem.text, str(problem.answer)), level=problem.level)

    def heldout_prompts(self) -> list[Prompt]:
        return list(self._heldout)
