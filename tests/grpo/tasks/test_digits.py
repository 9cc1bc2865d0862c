import json
import random

import pytest
from tokenizers import Tokenizer

from torchtitan_rl.grpo.tasks import DigitsTask, build_digits_tokenizer
from torchtitan_rl.grpo.tasks.digits import load_digits_tokenizer


def _ids(task: DigitsTask, text: str) -> list[int]:
    return task.tokenizer.encode(text).ids


def test_tokenizer_roundtrip_from_package_file():
    tokenizer = load_digits_tokenizer()
    text = "<bos>0123456789=+<eos><pad>"
    encoding = tokenizer.encode(text)
    assert encoding.tokens == ["<bos>", *"0123456789=+", "<eos>", "<pad>"]
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == text
    assert tokenizer.decode(tokenizer.encode("907=").ids) == "907="


def test_package_tokenizer_file_is_up_to_date_with_builder():
    # If this fails: python -m torchtitan_rl.grpo.tasks.digits --write-tokenizer
    shipped = json.loads(load_digits_tokenizer().to_str())
    built = json.loads(build_digits_tokenizer().to_str())
    assert shipped == built


def test_special_token_ids_and_vocab_size():
    task = DigitsTask()
    assert (task.pad_id, task.bos_id, task.eos_id) == (0, 1, 2)
    assert task.tokenizer.token_to_id("<unk>") == 3
    assert [task.tokenizer.token_to_id(str(d)) for d in range(10)] == list(range(4, 14))
    assert task.tokenizer.token_to_id("=") == 14
    assert task.vocab_size == 16


def test_prompt_is_bos_digits_equals():
    task = DigitsTask(n_digits=4)
    (prompt,) = task.sample_prompts(1, generator=random.Random(0))
    assert prompt.token_ids[0] == task.bos_id
    assert prompt.token_ids[-1] == task.tokenizer.token_to_id("=")
    assert len(prompt.token_ids) == 4 + 2
    assert prompt.text.startswith("<bos>") and prompt.text.endswith("=")
    assert _ids(task, prompt.text) == prompt.token_ids


@pytest.mark.parametrize(
    "mode, target", [("copy", "4071"), ("reverse", "1704"), ("repeat_first", "4444")]
)
def test_target_is_the_mode_function_of_the_digits(mode, target):
    task = DigitsTask(n_digits=4, mode=mode)
    prompt = task.make_prompt([4, 0, 7, 1])
    assert prompt.text == "<bos>4071="
    assert prompt.target == _ids(task, target)
    assert task.reward(prompt, _ids(task, target) + [task.eos_id]) == 1.0


def test_digits_reward_is_dense_and_exact():
    task = DigitsTask(n_digits=3, mode="copy")
    prompt = task.make_prompt([1, 2, 3])
    eos = task.eos_id

    def reward(text: str) -> float:
        return task.reward(prompt, _ids(task, text))

    assert reward("123<eos>") == 1.0
    assert reward("123") == 1.0
    assert reward("129<eos>") == pytest.approx(2 / 3)  # partial credit per digit
    assert reward("923<eos>") == pytest.approx(2 / 3)
    assert reward("321<eos>") == pytest.approx(1 / 3)  # position by position: only the 2
    assert reward("23<eos>") == 0.0  # shifted by one earns nothing
    assert reward("123999<eos>") == 1.0  # tokens after the n positions add nothing
    assert reward("12<eos>3") == pytest.approx(2 / 3)  # the answer ends at <eos>
    assert reward("<eos>123") == 0.0
    assert task.reward(prompt, []) == 0.0
    assert task.reward(prompt, [eos]) == 0.0


def test_random_policy_reward_is_low():
    task = DigitsTask()
    rng = random.Random(0)
    prompts = task.sample_prompts(20_000, generator=rng)
    rewards = [
        task.reward(p, [rng.randrange(task.vocab_size) for _ in range(8)]) for p in prompts
    ]
    mean = sum(rewards) / len(rewards)
    expected = task.random_policy_reward()
    assert mean == pytest.approx(expected, abs=0.005)
    assert expected < 1.0 / task.vocab_size


def test_sample_prompts_is_reproducible_from_the_generator():
    task = DigitsTask()
    first = task.sample_prompts(8, generator=random.Random(7))
    second = task.sample_prompts(8, generator=random.Random(7))
    assert first == second
    assert len({p.text for p in first}) > 1


def test_describe_shows_prompt_completion_target_and_reward():
    task = DigitsTask(mode="reverse")
    (prompt,) = task.sample_prompts(1, generator=random.Random(0))
    line = task.describe(prompt, prompt.target + [task.eos_id])
    assert prompt.text in line and "<eos>" in line and "reward 1.00" in line


def test_bad_constructor_args_raise_value_error_naming_field():
    with pytest.raises(ValueError, match="grpo.task"):
        DigitsTask(mode="sort")
    with pytest.raises(ValueError, match="grpo.task"):
        DigitsTask(n_digits=0)


def test_tokenizer_loads_with_from_file(tmp_path):
    path = tmp_path / "tok.json"
    path.write_text(build_digits_tokenizer().to_str())
    assert Tokenizer.from_file(str(path)).get_vocab_size() == 16
