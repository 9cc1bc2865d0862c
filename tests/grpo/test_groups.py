"""A step's scored groups: overlong penalty, dynamic sampling, signals, rewards shared over ranks."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import free_port
from torchtitan_rl.grpo.groups import Groups, fill_with_signal, overlong_penalty, rollout_metrics, shared_scores
from torchtitan_rl.grpo.tasks.base import Prompt


def _groups(rewards: list[list[float]], *, lengths: list[list[int]] | None = None, levels=None, tag: str = "",
            correct: list[list[bool]] | None = None) -> Groups:
    """Groups of these rewards; correct defaults to reward >= 1 (no format bonus)."""
    G = len(rewards[0])
    correct = correct if correct is not None else [[r >= 1 for r in row] for row in rewards]
    lengths = lengths or [[3] * G for _ in rewards]
    completions = [[7] * n for row in lengths for n in row]
    return Groups(
        group_size=G,
        prompts=[Prompt(token_ids=[1], text=f"{tag}{g}", target="", level=None if levels is None else levels[g])
                 for g in range(len(rewards))],
        prompt_ids=[[1]] * len(completions), completion_ids=completions, logprobs=[[0.0] * len(c) for c in completions],
        loss_mask=None, task_rewards_B=torch.tensor(rewards).flatten(), rewards_B=torch.tensor(rewards).flatten(),
        truncated_B=torch.tensor([n >= 8 for row in lengths for n in row]),
        correct_B=torch.tensor(correct).flatten(),
    )


def test_overlong_penalty_is_zero_then_linear_over_the_buffer():
    # max_tokens 10, buffer 4: free up to 6 tokens, then -0.25 per token down to -1 at 10.
    lengths = torch.tensor([0, 6, 7, 8, 10, 12])
    got = overlong_penalty(lengths, max_tokens=10, buffer=4, penalty=1.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, max_tokens=10, buffer=4, penalty=0.5), got / 2)


def test_dynamic_sampling_fills_the_batch_with_groups_that_have_signal():
    first = _groups([[1, 1], [0, 1], [0, 0], [1, 1]], tag="a")  # one group with signal of four
    # Each round draws only the groups still missing: 3, then 1.
    draws = {(1, 3): _groups([[0, 1], [1, 1], [1, 0]], tag="b"), (2, 1): _groups([[1, 0]], tag="c")}
    batch, stats = fill_with_signal(first, lambda r, n: draws[r, n], want=4, max_rounds=3)
    assert [p.text for p in batch.prompts] == ["a1", "b0", "b2", "c0"]  # in the order drawn
    assert not batch.uniform().any()
    assert stats == {"groups_dropped": 4.0, "groups_padded": 0.0, "sampling_rounds": 2.0,
                     "refill_prompts": 4.0, "refill_completion_tokens": 24.0}


def test_dynamic_sampling_drops_a_group_of_equal_accuracy_whatever_its_format_rewards():
    # DAPO's filter reads accuracy: group a0 is all wrong, but one answer earned the 0.1 format bonus, so its
    # rewards differ; a1 is all right with a length penalty on one. Both are dropped; a2 (one right) is kept.
    first = _groups([[0.0, 0.1], [1.0, 0.7], [1.1, 0.0]], tag="a",
                    correct=[[False, False], [True, True], [True, False]])
    draws = {(1, 2): _groups([[1.0, 0.0], [0.0, 1.0]], tag="b")}
    batch, stats = fill_with_signal(first, lambda r, n: draws[r, n], want=3, max_rounds=1)
    assert [p.text for p in batch.prompts] == ["a2", "b0", "b1"]
    assert stats["groups_dropped"] == 2.0 and stats["refill_prompts"] == 2.0


def test_dynamic_sampling_stops_after_the_bound_and_tops_up_with_dropped_groups():
    calls = []

    def draw(r, n):
        calls.append((r, n))
        return _groups([[0, 0]] * n, tag=f"r{r}")

    batch, stats = fill_with_signal(_groups([[0, 1], [1, 1], [0, 0]], tag="a"), draw, want=3, max_rounds=2)
    assert calls == [(1, 2), (2, 2)]
    assert [p.text for p in batch.prompts] == ["a0", "a1", "a2"]  # the one with signal, then dropped ones
    assert stats["groups_padded"] == 2.0 and stats["sampling_rounds"] == 2.0 and stats["groups_dropped"] == 6.0


def test_rollout_metrics_report_lengths_the_cut_share_and_rewards_per_level():
    groups = _groups([[1, 0], [1, 1], [0, 0]], lengths=[[2, 8], [4, 4], [8, 6]], levels=[1, 2, 1])
    m = rollout_metrics(groups)
    assert m["correct_frac"] == 3 / 6
    assert m["response_length_mean"] == 32 / 6 and m["response_length_max"] == 8
    assert m["truncated_frac"] == 2 / 6
    assert m["reward_mean/level_1"] == 0.25 and m["reward_std/level_1"] == pytest.approx(0.1875**0.5)
    assert m["reward_mean/level_2"] == 1.0 and m["reward_std/level_2"] == 0.0
    assert m["response_length_p90"] == 8.0  # sorted 2 4 4 6 8 8: position 0.9 * 5 = 4.5 lies between two 8s


def test_rollout_metrics_tell_right_answers_from_a_format_bonus():
    # A format bonus of 0.1 on every answer, one right: the reward rises with the bonus, correct_frac does not.
    groups = _groups([[1.1, 0.1], [0.1, 0.1]], correct=[[True, False], [False, False]])
    m = rollout_metrics(groups)
    assert m["correct_frac"] == 0.25 and groups.task_rewards_B.mean().item() == pytest.approx(0.35)


def _score_on_rank(rank: int, port: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    # A reward that depends on who computes it (as math-verify's wall-clock time limits can).
    out[rank] = shared_scores(lambda i: (i + 1000.0 * rank, -i), 7, device=torch.device("cpu")).tolist()
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes import torch: ~15 s
def test_rewards_are_computed_once_and_every_rank_gets_the_same():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_score_on_rank, args=(free_port(), out), nprocs=2)
        r0, r1 = out[0], out[1]
    # Rank 0 scored rows 0-3, rank 1 rows 4-6; each rank trains on the same values.
    assert r0 == r1 == [[0.0, 0.0], [1.0, -1.0], [2.0, -2.0], [3.0, -3.0], [1004.0, -4.0], [1005.0, -5.0],
                        [1006.0, -6.0]]
