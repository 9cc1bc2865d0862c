import random

import pytest

from tests.helpers import SAMPLE_DATASET
from torchtitan_rl.config import TaskConfig
from torchtitan_rl.grpo.tasks import DigitsTask, Prompt, Task, build_task, check_vocabulary
from torchtitan_rl.grpo.tasks.arithmetic import MathTask
from torchtitan_rl.grpo.tasks.dataset import DatasetTask
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


# ------------------------------------------------- tasks on a checkpoint's tokenizer


def make_configured_task(*, config, tokenizer_dir) -> Task:
    task = ConstantTask()
    task.seen = (config, tokenizer_dir)
    return task


def make_task_with_any_kwargs(**kwargs) -> Task:
    task = ConstantTask()
    task.seen = sorted(kwargs)
    return task


def test_user_factory_gets_the_keyword_args_it_names():
    config = TaskConfig(system_prompt="Be brief.")
    task = build_task(f"{__name__}:make_configured_task", config, tokenizer_dir="/some/folder")
    assert task.seen == (config, "/some/folder")
    assert build_task(f"{__name__}:make_task_with_any_kwargs", config).seen == ["config", "tokenizer_dir"]
    assert isinstance(build_task(f"{__name__}:make_constant_task", config, tokenizer_dir="/x"), ConstantTask)


@pytest.mark.parametrize("name, cls", [("math", MathTask), ("dataset", DatasetTask)])
def test_math_and_dataset_use_the_tokenizer_folder(name, cls, smollm2_dir):
    config = TaskConfig(heldout_size=5, path=str(SAMPLE_DATASET))
    task = build_task(name, config, tokenizer_dir=str(smollm2_dir))
    assert isinstance(task, cls) and task.vocab_size == 49152
    with pytest.raises(ValueError, match=r"task.tokenizer: grpo.task '.*' needs task.tokenizer or model.hf_checkpoint"):
        build_task(name, config)


def test_tokenizer_folder_without_tokenizer_names_the_field(tmp_path):
    with pytest.raises(ValueError, match=rf"task.tokenizer: no tokenizer.json in {tmp_path}"):
        build_task("math", TaskConfig(tokenizer=str(tmp_path)), tokenizer_dir=str(tmp_path))
    with pytest.raises(ValueError, match=rf"model.hf_checkpoint: no tokenizer.json in {tmp_path}"):
        build_task("math", TaskConfig(), tokenizer_dir=str(tmp_path))


def test_digits_on_a_pretrained_checkpoint_is_refused_naming_both_vocabularies(smollm2_dir):
    with pytest.raises(ValueError) as e:
        check_vocabulary(build_task("digits"), spec="digits", model_vocab_size=49152, hf_checkpoint=str(smollm2_dir))
    message = str(e.value)
    assert message.startswith("grpo.task 'digits': its tokenizer (16 token ids) is not the tokenizer of "
                              f"model.hf_checkpoint {smollm2_dir} (vocab_size 49152, tokenizer 49152 ids)")


def test_checkpoint_tokenizer_task_passes_the_vocabulary_check(smollm2_dir):
    task = build_task("math", TaskConfig(heldout_size=5), tokenizer_dir=str(smollm2_dir))
    check_vocabulary(task, spec="math", model_vocab_size=49152, hf_checkpoint=str(smollm2_dir))
    check_vocabulary(task, spec="math", model_vocab_size=49152 + 128, hf_checkpoint=None)  # padded embedding


def test_task_ids_beyond_the_models_vocabulary_are_refused(smollm2_dir):
    task = build_task("math", TaskConfig(heldout_size=5), tokenizer_dir=str(smollm2_dir))
    with pytest.raises(ValueError, match=r"grpo.task 'math': its tokenizer has 49152 token ids, more than "
                                         r"the model's vocab_size 32000"):
        check_vocabulary(task, spec="math", model_vocab_size=32000, hf_checkpoint=None)
