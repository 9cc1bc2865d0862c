import random

import pytest

from torchtitan_rl.grpo.tasks import DigitsTask, Prompt, Task, build_task
from torchtitan_rl.grpo.tasks.digits import load_digits_tokenizer


class ConstantTask(Task):
    """A user task: always prompts "<bos>7=", rewards completions starting with 7."""

    def __init__(self) -> None:
        self.tokenizer = load_digits_tokenizer()
        self.eos_id = self.tokenizer.token_to_id("<eos>")
        self.pad_id = self.tokenizer.token_to_id("<pad>")

    def sample_prompts(self, n: int, *, generator: random.Random) -> list[Prompt]:
        ids = self.tokenizer.encode("<bos>7=").ids
        return [Prompt(token_ids=ids, text="<bos>7=", target=ids[1]) for _ in range(n)]

    def reward(self, prompt: Prompt, completion_ids: list[int]) -> float:
        return float(completion_ids[:1] == [prompt.target])

    def describe(self, prompt: Prompt, completion_ids: list[int]) -> str:
        return f"{prompt.text} -> {completion_ids}"


def make_constant_task() -> Task:
    return ConstantTask()


def make_not_a_task() -> object:
    return "not a task"


def test_digits_spec_builds_default_task():
    task = build_task("digits")
    assert isinstance(task, DigitsTask)
    assert (task.mode, task.n_digits) == ("copy", 3)


@pytest.mark.parametrize("mode", ["copy", "reverse", "repeat_first"])
def test_digits_mode_spec_selects_mode(mode):
    assert build_task(f"digits:{mode}").mode == mode


def test_user_task_plugin_loads():
    task = build_task(f"{__name__}:make_constant_task")
    assert isinstance(task, ConstantTask)
    (prompt,) = task.sample_prompts(1, generator=random.Random(0))
    assert task.reward(prompt, [prompt.target, task.eos_id]) == 1.0
    assert task.vocab_size == 16


@pytest.mark.parametrize("spec", ["gsm8k", "", "Digits"])
def test_unknown_task_raises_value_error_naming_field(spec):
    with pytest.raises(ValueError, match=r"grpo\.task: unknown task"):
        build_task(spec)


def test_unknown_digits_mode_raises_value_error_naming_field():
    with pytest.raises(ValueError, match=r"grpo\.task: .*mode"):
        build_task("digits:sort")


def test_unimportable_module_raises_value_error_naming_field():
    with pytest.raises(ValueError, match=r"grpo\.task: cannot import module 'no_such_pkg.tasks'"):
        build_task("no_such_pkg.tasks:make")


def test_missing_factory_raises_value_error_naming_field():
    with pytest.raises(ValueError, match=r"grpo\.task: .*no callable 'missing'"):
        build_task(f"{__name__}:missing")


def test_factory_returning_non_task_raises_value_error_naming_field():
    with pytest.raises(ValueError, match=r"grpo\.task: .*returned str"):
        build_task(f"{__name__}:make_not_a_task")
