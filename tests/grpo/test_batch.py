"""Rollouts -> training tensors, and the trainer-vs-generator logprob mismatch."""

import pytest
import torch

from torchtitan_rl.grpo.batch import logprob_mismatch, pack_rollouts, pack_versions, rank_rows

PAD = 0


def test_pack_rollouts_puts_mask_and_logprobs_on_the_completion_tokens():
    prompts = [[1, 5, 6, 14], [1, 7, 14], [1, 7, 14]]
    completions = [[8, 2], [9, 9, 9, 2], []]
    logprobs = [[-0.5, -0.25], [-1.0, -2.0, -3.0, -4.0], []]

    tokens_BL, mask_BL, gen_BL = pack_rollouts(prompts, completions, logprobs, pad_id=PAD)

    assert tokens_BL.dtype == torch.long and tokens_BL.shape == (3, 7)
    assert tokens_BL.tolist() == [
        [1, 5, 6, 14, 8, 2, PAD],
        [1, 7, 14, 9, 9, 9, 2],
        [1, 7, 14, PAD, PAD, PAD, PAD],
    ]
    assert mask_BL.tolist() == [
        [0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1, 1, 1],
        [0, 0, 0, 0, 0, 0, 0],
    ]
    # Column t holds the logprob of token t (the trainer's convention), 0 elsewhere.
    assert gen_BL.tolist() == [
        [0, 0, 0, 0, -0.5, -0.25, 0],
        [0, 0, 0, -1.0, -2.0, -3.0, -4.0],
        [0, 0, 0, 0, 0, 0, 0],
    ]
    assert not mask_BL[:, 0].any()  # Trainer.train_step's requirement


def test_pack_versions_puts_each_tokens_version_where_pack_rollouts_puts_its_logprob():
    prompts = [[1, 5, 6, 14], [1, 7, 14]]
    completions = [[8, 2], [9, 9, 9, 2]]
    versions = [[4, 5], [3, 3, 5, 5]]  # the second sequence was cut after two tokens and continued two versions on
    tokens_BL, mask_BL, _ = pack_rollouts(prompts, completions, [[0.0] * len(c) for c in completions], pad_id=PAD)
    versions_BL = pack_versions(prompts, versions, length=tokens_BL.shape[1])
    assert versions_BL.tolist() == [[-1, -1, -1, -1, 4, 5, -1], [-1, -1, -1, 3, 3, 5, 5]]
    assert ((versions_BL >= 0) == mask_BL.bool()).all()


def test_pack_rollouts_uses_the_given_pad_id():
    tokens_BL, mask_BL, _ = pack_rollouts([[1, 2], [1]], [[3], [4]], [[-1.0], [-1.0]], pad_id=15)
    assert tokens_BL.tolist() == [[1, 2, 3], [1, 4, 15]]
    assert mask_BL.tolist() == [[0, 0, 1], [0, 1, 0]]


def test_pack_rollouts_rejects_a_logprob_count_that_does_not_fit():
    with pytest.raises(AssertionError, match="one generator logprob per completion token"):
        pack_rollouts([[1]], [[3, 4]], [[-1.0]], pad_id=PAD)


def test_logprob_mismatch_counts_only_scored_tokens():
    mask_BL = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.float32)
    generator_BL = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, -0.5, -0.5, -0.5]])
    # Unscored positions hold large differences that must not count.
    trainer_BL = torch.tensor([[9.0, -1.0, -2.5, 9.0], [9.0, -0.25, -0.5, -0.375]], dtype=torch.bfloat16)

    m = logprob_mismatch(trainer_BL, generator_BL, mask_BL)

    # |diffs| over the 5 scored tokens: 0, 0.5, 0.25, 0, 0.125
    assert m == {
        "mismatch_mean": pytest.approx(0.875 / 5, abs=0, rel=1e-7),
        "mismatch_max": 0.5,
        "mismatch_frac_tokens": pytest.approx(3 / 5, rel=1e-7),
    }


def test_logprob_mismatch_is_zero_for_equal_logprobs_and_for_no_tokens():
    lp_BL = torch.tensor([[0.0, -1.3, -0.7]])
    zeros = {"mismatch_mean": 0.0, "mismatch_max": 0.0, "mismatch_frac_tokens": 0.0}
    assert logprob_mismatch(lp_BL, lp_BL.clone(), torch.tensor([[0.0, 1.0, 1.0]])) == zeros
    assert logprob_mismatch(lp_BL, lp_BL + 1, torch.zeros(1, 3)) == zeros


def test_ranks_get_equal_row_counts_and_nearly_equal_tokens_of_a_batch_listing_its_long_groups_first():
    # A partial-rollouts batch: its oldest groups, carried over because they ran long, first (8 groups of 4).
    torch.manual_seed(0)
    lengths = sorted(torch.randint(100, 8000, (32,)).tolist(), reverse=True)
    lengths = lengths[:12] + torch.randint(100, 2000, (20,)).tolist()
    for ranks in (2, 4):
        shares = [rank_rows(lengths, rank=r, ranks=ranks).tolist() for r in range(ranks)]
        assert sorted(row for share in shares for row in share) == list(range(32))  # every row once
        assert all(share == sorted(share) and len(share) == 32 // ranks for share in shares)
        tokens = [sum(lengths[row] for row in share) for share in shares]
        assert max(tokens) - min(tokens) <= max(lengths)
        blocks = [sum(lengths[r * 32 // ranks:(r + 1) * 32 // ranks]) for r in range(ranks)]
        assert max(blocks) - min(blocks) > 3 * max(lengths)  # what contiguous blocks gave: one rank most of it


def test_one_rank_trains_every_row_in_the_batch_order():
    assert rank_rows([5, 9, 1], rank=0, ranks=1).tolist() == [0, 1, 2]
