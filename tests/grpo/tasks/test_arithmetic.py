import random
import re

import pytest

from torchtitan_rl.config import TaskConfig
from torchtitan_rl.grpo.tasks.arithmetic import (
    LEVELS,
    MathTask,
    heldout_problems,
    is_heldout,
    make_problem,
    train_problem,
)


@pytest.fixture(scope="module")
def task(smollm2_dir):
    return MathTask(TaskConfig(heldout_size=100), tokenizer_dir=str(smollm2_dir))


def test_same_seed_same_problems_and_prompts(task):
    a = task.sample_prompts(32, generator=random.Random(7))
    b = task.sample_prompts(32, generator=random.Random(7))
    assert [p.token_ids for p in a] == [p.token_ids for p in b]
    assert [p.target for p in a] == [p.target for p in b]
    c = task.sample_prompts(32, generator=random.Random(8))
    assert [p.text for p in a] != [p.text for p in c]


def test_train_stream_never_draws_a_heldout_problem():
    heldout = {p.text for p in heldout_problems(LEVELS, 500)}
    assert len(heldout) == 500 and all(map(is_heldout, heldout))
    rng = random.Random(0)
    train = [train_problem(LEVELS, rng) for _ in range(5000)]
    assert not heldout & {p.text for p in train}
    assert not any(is_heldout(p.text) for p in train)


def test_heldout_set_is_fixed_and_covers_every_level_equally():
    a, b = heldout_problems(LEVELS, 100), heldout_problems(LEVELS, 100)
    assert a == b  # no dependence on the run's seed
    assert [p.level for p in a[:10]] == [1, 2, 3, 4, 5] * 2
    assert heldout_problems(LEVELS, 20) == a[:20]  # num_prompts takes a prefix of the same set


def test_levels_are_graded_by_steps_and_size_of_numbers():
    rng = random.Random(0)
    by_level = {level: [make_problem(level, rng) for _ in range(300)] for level in LEVELS}
    steps = {level: {p.steps for p in ps} for level, ps in by_level.items()}
    assert steps == {1: {1}, 2: {1}, 3: {2}, 4: {2}, 5: {3}}
    ops = {level: sum(len(re.findall(r"\d+", p.text)) for p in ps) / len(ps) for level, ps in by_level.items()}
    assert ops[1] <= ops[3] <= ops[5]  # more numbers to combine as levels rise
    # Levels 1 and 2 differ by operation: sums/differences vs products/quotients.
    assert max(p.answer for p in by_level[1]) <= 40 < max(p.answer for p in by_level[2])


def test_answers_are_whole_and_nonnegative_at_every_level():
    rng = random.Random(1)
    for level in LEVELS:
        for _ in range(2000):
            problem = make_problem(level, rng)
            assert isinstance(problem.answer, int) and problem.answer >= 0, problem


def test_only_the_configured_levels_are_drawn(smollm2_dir):
    rng = random.Random(0)
    assert {train_problem((1, 2), rng).level for _ in range(200)} == {1, 2}
    ones = sum(train_problem((1, 1, 1, 2), rng).level == 1 for _ in range(2000))
    assert 1350 < ones < 1650  # a repeated level is drawn more often: 3 in 4
    task = MathTask(TaskConfig(levels=(2,), heldout_size=10), tokenizer_dir=str(smollm2_dir))
    assert all(p.target.isdigit() for p in task.heldout_prompts())


def test_prompt_is_the_chat_template_with_system_prompt_and_answer_format(task):
    (prompt,) = task.sample_prompts(1, generator=random.Random(0))
    assert prompt.text.startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert prompt.text.endswith("Put the final answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    assert task.tokenizer.decode(prompt.token_ids) == prompt.text
    assert prompt.token_ids[0] == task.tokenizer.convert_tokens_to_ids("<|im_start|>")  # no doubled BOS
    assert task.eos_id == task.tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_reward_reads_the_decoded_completion(smollm2_dir):
    task = MathTask(TaskConfig(heldout_size=5, format_reward_weight=0.5), tokenizer_dir=str(smollm2_dir))
    (prompt,) = task.sample_prompts(1, generator=random.Random(0))

    def ids(text):
        return task.tokenizer(text, add_special_tokens=False)["input_ids"] + [task.eos_id]

    wrong = str(int(prompt.target) + 1)
    assert task.reward(prompt, ids(f"So \\boxed{{{prompt.target}}}.")) == 1.5
    assert task.reward(prompt, ids(f"The answer is {prompt.target}")) == 1.0
    assert task.reward(prompt, ids(f"\\boxed{{{wrong}}}")) == 0.5
    assert task.reward(prompt, ids(wrong)) == 0.0
    # Held-out accuracy counts correctness only, not the format bonus.
    assert task.correct(prompt, ids(f"The answer is {prompt.target}"))
    assert not task.correct(prompt, ids(f"\\boxed{{{wrong}}}"))


def test_empty_system_prompt_leaves_the_templates_default(smollm2_dir):
    task = MathTask(TaskConfig(heldout_size=5, system_prompt="", instruction=""), tokenizer_dir=str(smollm2_dir))
    prompt = task.heldout_prompts()[0]
    assert "named SmolLM" in prompt.text  # SmolLM2's own default system message
    assert prompt.text.endswith("?<|im_end|>\n<|im_start|>assistant\n")
