import threading

import pytest

from torchtitan_rl.grpo import rewards


@pytest.mark.parametrize(
    "text",
    [
        "3 + 4 = 7, so the answer is \\boxed{7}.",
        "The answer is 7",
        "7",
        "I first thought 6. The final answer: 7.",  # the last number counts
        "$\\boxed{7}$",
        "7.0",
    ],
)
def test_correct_answer_scores_one(text):
    assert rewards.correct(text, "7") == 1.0


@pytest.mark.parametrize("text", ["\\boxed{8}", "The answer is 70", "", "no idea", "\\boxed{}"])
def test_wrong_or_missing_answer_scores_zero(text):
    assert rewards.correct(text, "7") == 0.0


def test_boxed_answer_wins_over_a_later_number():
    assert rewards.correct("\\boxed{12}, since 3 * 4 is 12 and not 13", "12") == 1.0


def test_thousands_separators_match_either_way():
    assert rewards.correct("\\boxed{1,080}", "1080") == 1.0
    assert rewards.correct("so 1080 sticks", "1080") == 1.0


def test_format_reward_wants_a_nonempty_box_right_or_wrong():
    assert rewards.boxed_format("so \\boxed{8}", "7") == 1.0
    assert rewards.boxed_format("\\boxed{\\frac{1}{2}}", "7") == 1.0  # nested braces
    assert rewards.boxed_format("the answer is 7", "7") == 0.0
    assert rewards.boxed_format("\\boxed{ }", "7") == 0.0
    assert rewards.boxed_format("\\boxed{7", "7") == 0.0  # never closed


def test_reward_fns_add_the_format_term_only_with_a_weight():
    assert rewards.reward_fns(0.0) == [(1.0, rewards.correct)]
    assert rewards.reward_fns(0.2) == [(1.0, rewards.correct), (0.2, rewards.boxed_format)]


def test_scoring_works_outside_the_main_thread():
    # math-verify's time limit is a SIGALRM handler, which only the main thread may install.
    out = []
    thread = threading.Thread(target=lambda: out.append(rewards.correct("\\boxed{42}", "42")))
    thread.start()
    thread.join()
    assert out == [1.0]
