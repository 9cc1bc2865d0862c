"""Micro-batch plans: rows sorted by length, cut by a row cap and a token budget."""

import torch

from torchtitan_rl.trainer.micro_batches import plan, row_lengths


def test_row_lengths_end_at_the_last_scored_position():
    score_BL = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 1, 0, 1]], dtype=torch.bool)
    assert row_lengths(score_BL).tolist() == [3, 0, 5]


def test_plan_sorts_by_length_and_keeps_rows_times_longest_within_the_budget():
    lengths_B = torch.tensor([3, 9, 0, 5, 9, 2, 5])

    batches = plan(lengths_B, max_rows=8, max_tokens=18)

    assert [(mb.rows.tolist(), mb.length) for mb in batches] == [([1, 4], 9), ([3, 6, 0], 5), ([5], 2)]
    assert all(len(mb.rows) * mb.length <= 18 for mb in batches)


def test_plan_gives_a_row_longer_than_the_budget_its_own_micro_batch_and_caps_rows():
    assert [mb.rows.tolist() for mb in plan(torch.tensor([4, 30, 4]), max_rows=8, max_tokens=10)] == [[1], [0, 2]]
    # No token budget: micro_batch_size rows, in order when lengths are equal (a stable sort).
    assert [mb.rows.tolist() for mb in plan(torch.tensor([4, 4, 4]), max_rows=2, max_tokens=0)] == [[0, 1], [2]]
