import pytest
import torch

from torchtitan_rl.grpo import group_advantages


def test_identical_rewards_give_zero_advantage():
    # 0.1 is not exact in binary: a naive (r - mean) / (std + eps) gives
    # rounding noise divided by eps here, not zero.
    rewards_B = torch.tensor([0.1] * 8 + [1.0] * 8 + [0.0] * 8)
    for norm in ("group_std", "none"):
        adv_B = group_advantages(rewards_B, group_size=8, norm=norm)
        assert torch.equal(adv_B, torch.zeros(24)), norm


def test_group_std_matches_hand_computed_values():
    # mean 0.5, population std 0.5 -> advantages +-1 (up to eps).
    rewards_B = torch.tensor([0.0, 1.0, 0.0, 1.0])
    adv_B = group_advantages(rewards_B, group_size=4, norm="group_std", eps=0.0)
    assert torch.allclose(adv_B, torch.tensor([-1.0, 1.0, -1.0, 1.0]))


def test_group_std_advantages_have_zero_mean_and_unit_variance_per_group():
    rewards_B = torch.rand(6 * 8, generator=torch.Generator().manual_seed(0))
    adv_PG = group_advantages(rewards_B, group_size=8, norm="group_std", eps=0.0).view(6, 8)
    # fp32 mean/std of 8 O(1) values: rounding ~1e-7.
    assert torch.allclose(adv_PG.mean(dim=1), torch.zeros(6), atol=1e-6)
    assert torch.allclose(adv_PG.pow(2).mean(dim=1), torch.ones(6), atol=1e-5)


def test_none_norm_only_subtracts_group_mean():
    rewards_B = torch.tensor([0.0, 0.5, 1.0, 0.2, 0.2, 0.8])
    adv_B = group_advantages(rewards_B, group_size=3, norm="none")
    assert torch.allclose(adv_B, torch.tensor([-0.5, 0.0, 0.5, -0.2, -0.2, 0.4]))


def test_groups_are_contiguous_and_independent():
    rewards_B = torch.tensor([0.0, 1.0, 0.3, 0.9])
    changed_B = torch.tensor([0.0, 1.0, 0.7, 0.1])
    adv_B = group_advantages(rewards_B, group_size=2, norm="group_std")
    changed_adv_B = group_advantages(changed_B, group_size=2, norm="group_std")
    assert torch.equal(adv_B[:2], changed_adv_B[:2])
    assert adv_B[0] < 0 < adv_B[1]


def test_group_of_one_gives_zero_not_nan():
    adv_B = group_advantages(torch.tensor([0.3, 0.7]), group_size=1, norm="group_std")
    assert torch.equal(adv_B, torch.zeros(2))


def test_bad_norm_raises_value_error_naming_field():
    with pytest.raises(ValueError, match="grpo.advantage_norm"):
        group_advantages(torch.zeros(4), group_size=2, norm="batch_std")
