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
    assert rewards.reward_fns(0.0, "expression") == [(1.0, rewards.CORRECT["expression"])]


DEGENERATE = "38 + 81 = 38 + 81 = 38 + 81 = 38 + 81"
"""How the base SmolLM2's completion ended when an outside evaluation (math-verify alone) counted it right for 119."""


def test_an_unevaluated_expression_is_no_numeric_answer_unless_expressions_are_allowed():
    assert rewards.correct(DEGENERATE, "119") == 0.0  # the default: a number
    assert rewards.correct(DEGENERATE, "119", "expression") == 1.0  # math-verify's symbolic equality
    assert rewards.CORRECT["expression"](DEGENERATE, "119") == 1.0


@pytest.mark.parametrize("text, answer", [
    ("\\boxed{38 + 81}", "119"), ("so 7 * 17", "119"), ("\\boxed{2^3}", "8"), ("(30 + 20)", "50"),
    ("\\boxed{\\sqrt{4}}", "2"),
])
def test_other_expressions_score_only_as_expressions(text, answer):
    assert rewards.correct(text, answer) == 0.0
    assert rewards.correct(text, answer, "expression") == 1.0


@pytest.mark.parametrize("text, answer", [
    ("38 + 81 = 119", "119"), ("\\boxed{119}", "119"), ("\\boxed{1,080}", "1080"), ("The answer is -3.", "-3"),
    ("119.0", "119"), ("\\boxed{50\\%}", "50"), ("50%", "50"), ("\\boxed{\\frac{1}{2}}", "0.5"), ("0.5", "1/2"),
    ("\\boxed{\\$12}", "12"),
])
def test_numbers_as_written_score_either_way(text, answer):
    assert rewards.correct(text, answer) == rewards.correct(text, answer, "expression") == 1.0


@pytest.mark.parametrize("text, answer", [("\\boxed{1 + x^2}", "x^2+1"), ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}")])
def test_a_non_numeric_reference_is_compared_symbolically_either_way(text, answer):
    assert rewards.correct(text, answer) == rewards.correct(text, answer, "expression") == 1.0


def test_scoring_works_outside_the_main_thread():
    # math-verify's time limit is a SIGALRM handler, which only the main thread may install.
    out = []
    thread = threading.Thread(target=lambda: out.append(rewards.correct("\\boxed{42}", "42")))
    thread.start()
    thread.join()
    assert out == [1.0]
