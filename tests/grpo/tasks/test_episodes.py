"""Multi-turn episodes (tasks/episodes.py) on the real engine, and the calculator tool.

The engine runs the tiny Qwen3 with trainer weights, so its samples are random
digits; the test's tool is called by any digit 0-4 and answers "==". That exercises
every part of an episode (cut after the call, masked tool tokens, the next
turn conditioned on all of it, turn and token budgets) without needing a
model that knows what a tool is. The calculator task's own episodes on
SmolLM2 run in the GPU benchmark (docs/benchmarks.md).
"""

import dataclasses
import random

import pytest

from tests.helpers import BF16_MISMATCH_MEAN, make_generator, reference_logprobs, sync_model, trainer_model
from torchtitan_rl.config import EvalConfig, SamplingConfig, TaskConfig
from torchtitan_rl.grpo.batch import pack_rollouts
from torchtitan_rl.grpo.evaluate import Evaluator
from torchtitan_rl.grpo.tasks.calculator import CalculatorTask, calculate, find_call
from torchtitan_rl.grpo.tasks.digits import DigitsTask
from torchtitan_rl.grpo.tasks.episodes import ToolTask, _Episode

MAX_TOTAL = 24
CALLS, EQ = {4, 5, 6, 7, 8}, 14
"""Token ids of "0".."4" (a tool call) and "=" in the digits tokenizer."""


class DigitTool(ToolTask, DigitsTask):
    """Digits prompts; a turn calls the tool by writing a digit 0-4, and the tool answers "==" ."""

    max_turns = 3

    def call_tool(self, text):
        return "==" if any(d in text for d in "01234") else None


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The tiny model and a generator serving its weights (version 4)."""
    model = trainer_model(seed=0)
    generator = make_generator(tmp_path_factory.mktemp("gen"))
    sync_model(generator, model, version=4)
    yield model, generator
    generator.close()


@pytest.fixture(scope="module")
def episodes(engine):
    model, generator = engine
    task = DigitTool(mode="repeat_first")
    prompts = task.sample_prompts(8, generator=random.Random(0))
    sampling = SamplingConfig(max_tokens=8)
    # A training step's seed with job.seed 42: its later turns' seeds pass 2**63 before sample_seed folds them.
    play = dict(n=2, seed=42 * 1_000_003 + 7, sampling=sampling, max_total_tokens=MAX_TOTAL)
    return model, task, prompts, task.rollouts(generator, prompts, **play), task.rollouts(generator, prompts, **play)


def test_an_episode_is_turns_cut_after_each_call_with_masked_tool_answers(episodes):
    _, task, prompts, r, _ = episodes
    assert r.weight_version == 4 and len(r.completion_ids) == 16
    assert r.prompt_ids == [p.token_ids for p in prompts for _ in range(2)]
    calls = []
    for ids, mask, lps, prompt in zip(r.completion_ids, r.loss_mask, r.logprobs, r.prompt_ids):
        assert len(ids) == len(mask) == len(lps) and len(prompt) + len(ids) <= MAX_TOTAL
        # Walk the episode turn by turn: policy tokens up to and including the first 7, then the tool's "==".
        i, turns = 0, 0
        while i < len(ids):
            turns += 1
            j = i
            while j < len(ids) and mask[j] == 1:
                j += 1
            policy = ids[i:j]
            if turns < task.max_turns:  # the last turn's call is not answered, so not cut either
                assert not CALLS & set(policy[:-1]), policy  # cut right after the first call
            if j < len(ids):  # a tool answer follows: the turn ended with its call
                assert policy[-1] in CALLS and ids[j:j + 2] == [EQ, EQ] and mask[j:j + 2] == [0, 0]
                assert lps[j:j + 2] == [0.0, 0.0]
                j += 2
            i = j
        assert turns <= task.max_turns
        calls.append(mask.count(0) // 2)
    assert max(calls) >= 2 and min(calls) == 0, calls  # some episodes call twice, some never


def test_later_turns_are_sampled_from_exactly_the_sequence_the_trainer_scores(episodes):
    """The generator's logprobs of turn 2 and 3 tokens equal the trainer's on prompt + episode so far."""
    model, task, _, r, _ = episodes
    tokens_BL, mask_BL, gen_BL = pack_rollouts(r.prompt_ids, r.completion_ids, r.logprobs, pad_id=task.pad_id,
                                               loss_mask=r.loss_mask)
    assert mask_BL.sum().item() == sum(sum(m) for m in r.loss_mask)  # tool tokens are not scored
    errors = []
    for prompt, ids, lps, mask in zip(r.prompt_ids, r.completion_ids, r.logprobs, r.loss_mask):
        if 0 not in mask:
            continue
        ref = reference_logprobs(model, prompt, ids)
        after_a_call = [k for k in range(mask.index(0), len(ids)) if mask[k]]
        errors += [abs(lps[k] - ref[k].item()) for k in after_a_call]
    assert errors and sum(errors) / len(errors) < BF16_MISMATCH_MEAN, errors


def test_same_seed_same_episodes(episodes):
    *_, a, b = episodes
    assert (a.completion_ids, a.loss_mask, a.logprobs) == (b.completion_ids, b.loss_mask, b.logprobs)


class HeldoutDigitTool(DigitTool):
    """Held-out prompts, and a tool called by "=" (what the random model writes greedily), answering "00"."""

    def heldout_prompts(self):
        return self.sample_prompts(8, generator=random.Random(1))

    def call_tool(self, text):
        return "00" if "=" in text else None


def test_the_heldout_evaluation_of_a_tool_task_plays_its_episodes(engine):
    """The loop's evaluation asks a tool task as training does (its episodes, turn and token budgets), greedy."""
    _, generator = engine
    task = HeldoutDigitTool(mode="repeat_first")
    evaluator = Evaluator(EvalConfig(every_n_steps=1, max_tokens=8), task=task, spec="digits", seed=3,
                          sampling=SamplingConfig(max_tokens=8), max_total_tokens=MAX_TOTAL)
    evaluator.run(generator, step=0)
    greedy = SamplingConfig(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=8)
    played = task.rollouts(generator, task.heldout_prompts(), n=1, seed=0, sampling=greedy,
                           max_total_tokens=MAX_TOTAL)
    assert all(0 in mask for mask in played.loss_mask)  # the tool answered: several turns
    assert [r["completion"] for r in evaluator.results["heldout"]] == list(map(task.completion_text,
                                                                             played.completion_ids))


@pytest.mark.parametrize("expression, value", [
    ("7 * 12 - 5", "79"), ("(3 + 4) / 2", "3.5"), ("-3", "-3"), ("2.5 * 2", "5"),
    ("1 / 0", "error"), ("9 ** 9 ** 9", "error"), ("__import__('os')", "error"), ("x + 1", "error"),
    # SmolLM2-135M's calls, greedy, on held-out problems: its guess after "=" is replaced by the value.
    ("10 * 9 = 90", "90"), ("15 * 7 = 115", "105"), ("25 * 5 = 125 shells", "125"),
    ("72 * 8 * 1 = 72 * 8 = 560", "576"), ("COINS: 19", "error"),
])
def test_calculator_evaluates_arithmetic_only(expression, value):
    assert calculate(expression) == value


def test_a_turn_closed_by_smollm2s_token_gets_the_answer_the_prompt_shows(smollm2_dir):
    """SmolLM2 closes a call with the token "><" (as the prompt's example tokenizes "</calc><result>"): the
    episode reads "</calc><result>", not "</calc><<result>"."""
    task = CalculatorTask(TaskConfig(), tokenizer_dir=str(smollm2_dir))
    assert task.call_tool("7 * 12</calc>") == task.call_tool("7 * 12</calc> so") == "<result>84</result>"
    assert task.call_tool("7 * 12</calc><") == "result>84</result>"
    ids = task.tokenizer("10 * 9 = 90</calc><result>90</result> So 90.", add_special_tokens=False)["input_ids"]
    episode = _Episode(prompt=[1])
    task._extend(episode, ids, [0.0] * len(ids), last_turn=False, room=400)
    policy = [t for t, m in zip(episode.tokens, episode.mask) if m]
    assert task.tokenizer.decode(policy) == "10 * 9 = 90</calc><"  # cut after the token that closed the call
    assert task.tokenizer.decode(episode.tokens) == "10 * 9 = 90</calc><result>90</result>"
    assert task.completion_text(episode.tokens) == "10 * 9 = 90</calc>"  # the tool's answer is not the policy's


def test_a_calculator_episode_that_stops_at_the_tools_answer_has_not_answered(smollm2_dir):
    """"8 + 8</calc><result>16</result>" then eos (SmolLM2 ended 9 of 40 greedy held-out episodes right after a
    result): the tool's 16 is not the policy's answer, whatever task.numeric_answer says."""
    for numeric_answer in ("number", "expression"):
        task = CalculatorTask(TaskConfig(numeric_answer=numeric_answer), tokenizer_dir=str(smollm2_dir))
        prompt = dataclasses.replace(task.heldout_prompts()[0], target="16")

        def ids(text):
            return task.tokenizer(text, add_special_tokens=False)["input_ids"] + [task.eos_id]

        assert task.completion_text(ids("8 + 8</calc><result>16</result>")) == "8 + 8</calc>"
        assert not task.correct(prompt, ids("8 + 8</calc><result>16</result>"))
        assert task.correct(prompt, ids("8 + 8</calc><result>16</result> So 16 stickers."))


def test_calculator_call_syntax():
    # The prompt opens the reply with "<calc>": the first call has no opening tag in the reply's text.
    assert find_call("7 * 12</calc> so") == "7 * 12"
    assert find_call("first <calc>2+2</calc> then <calc>3+3</calc>") == "2+2"
    assert find_call("no call here") is None
