"""Partial rollouts' buffer (rollout/partial.py): which groups a request holds, which train, which wait, which go.

The engine's side (the stop rule, continuing a cut sample) is tested with the real engine in
tests/engine/test_partial_engine.py; here the engine's answer is written by hand, so each rule is seen alone.
"""

import pickle

import pytest

from torchtitan_rl.config import JobConfig
from torchtitan_rl.engine.rollouts import Rollouts
from torchtitan_rl.grpo.tasks.base import Prompt
from torchtitan_rl.rollout.base import prompt_blocks
from torchtitan_rl.rollout.partial import UnfinishedBuffer

G = 2


def _cfg(*, prompts: int = 2, over: int = 1, age: int = 1, staleness: int = 0) -> JobConfig:
    cfg = JobConfig()
    cfg.grpo.prompts_per_step, cfg.grpo.group_size, cfg.grpo.max_staleness = prompts, G, staleness
    cfg.grpo.partial.enable, cfg.grpo.partial.over_sample, cfg.grpo.partial.max_token_age = True, over, age
    return cfg


def _prompts(*names: int) -> list[Prompt]:
    return [Prompt(token_ids=[1, n], text=str(n), target=n) for n in names]


def _answer(request, *, version: int, grow: dict[int, int], done: set[int]) -> Rollouts:
    """What an engine at ``version`` returns for ``request``: sample b gets ``grow[b]`` more tokens (token id =
    b, logprob -version - 1) and ends if b is in ``done``."""
    so_far = request.so_far
    completions, logprobs, versions, finished = [], [], [], []
    for b, (c, lp, v, f) in enumerate(zip(so_far.completion_ids, so_far.logprobs, so_far.versions, so_far.finished)):
        more = 0 if f else grow.get(b, 0)
        completions.append(c + [b] * more)
        logprobs.append(lp + [-version - 1.0] * more)
        versions.append(v + [version] * more)
        finished.append(f or b in done)
    return Rollouts(so_far.prompt_ids, completions, logprobs, weight_version=version, versions=versions,
                    finished=finished)


def test_a_request_holds_the_carried_groups_then_new_ones_up_to_the_over_sampled_pool():
    buffer = UnfinishedBuffer(_cfg(prompts=2, over=1))
    assert buffer.new_groups_wanted() == 3
    pool, ask = buffer.request(0, _prompts(10, 11, 12), seed=5)
    assert [g.number for g in pool.groups] == [0, 1, 2] and ask["n"] == G and ask["seed"] == 5
    assert ask["prompts"] == [[1, 10], [1, 11], [1, 12]]
    assert ask["partial"].need == 2 and ask["partial"].due == [False] * 3
    assert ask["partial"].so_far.completion_ids == [[]] * 6 and ask["partial"].groups == [0, 1, 2]


def test_the_oldest_finished_groups_train_and_the_rest_wait_with_their_tokens():
    buffer = UnfinishedBuffer(_cfg(prompts=2, over=1))
    pool, ask = buffer.request(0, _prompts(10, 11, 12), seed=0)
    # Groups 1 and 2 finish; group 0's second sample is cut after 3 tokens.
    answer = _answer(ask["partial"], version=0, grow={b: 3 for b in range(6)}, done={0, 2, 3, 4, 5})
    prompts, batch = buffer.take(pool, answer)
    assert [p.target for p in prompts] == [11, 12]
    assert batch.completion_ids == [[2] * 3, [3] * 3, [4] * 3, [5] * 3] and batch.finished is None
    assert batch.generated == 18 and batch.versions == [[0] * 3] * 4
    assert buffer.stats == {"partial_carried_samples": 1.0, "partial_carried_tokens": 5.0,  # prompt 2 + 3 cut
                            "partial_carried_groups": 1.0, "partial_dropped_samples": 0.0, "partial_due_groups": 0.0}
    # Next request: group 0 first (carried, its finished sample kept as is), then two new groups.
    assert buffer.new_groups_wanted() == 2
    pool, ask = buffer.request(1, _prompts(13, 14), seed=0)
    assert [g.number for g in pool.groups] == [0, 3, 4]
    assert ask["partial"].so_far.completion_ids[:2] == [[0] * 3, [1] * 3]
    assert ask["partial"].so_far.finished[:2] == [True, False]
    # Carried from request 0 (version 0) into request 1: at request 2 its tokens would be 2 > 1 versions old.
    assert ask["partial"].due == [True, False, False]
    # The cut sample continues under version 1: its tokens carry both versions, and its logprobs both samplers'.
    answer = _answer(ask["partial"], version=1, grow={1: 2, 2: 1, 3: 1}, done={1, 2, 3})
    prompts, batch = buffer.take(pool, answer)
    assert [p.target for p in prompts] == [10, 13]
    assert batch.versions[1] == [0, 0, 0, 1, 1] and batch.logprobs[1] == [-1.0] * 3 + [-2.0] * 2
    assert batch.generated == 4 and buffer.stats["partial_due_groups"] == 1


def test_two_engines_each_get_a_share_of_the_carried_groups_and_the_oldest_finished_train():
    # Colocated on two ranks, each engine generates a contiguous block of the request (prompt_blocks): oldest
    # first, the first engine would get every carried group (the long samples) and wait for them alone.
    buffer = UnfinishedBuffer(_cfg(prompts=2, over=2, age=3), engines=2)
    pool, ask = buffer.request(0, _prompts(10, 11, 12, 13), seed=0)
    assert [g.number for g in pool.groups] == [0, 2, 1, 3] and ask["partial"].groups == [0, 2, 1, 3]
    assert ask["prompts"] == [[1, 10], [1, 12], [1, 11], [1, 13]]
    # Groups 2 and 3 finish; 0 and 1 are cut after 3 tokens.
    prompts, _ = buffer.take(pool, _answer(ask["partial"], version=0, grow={b: 3 for b in range(8)},
                                           done={2, 3, 6, 7}))
    assert [p.target for p in prompts] == [12, 13] and [g.number for g in buffer.groups] == [0, 1]
    pool, ask = buffer.request(1, _prompts(14, 15), seed=0)
    assert [g.number for g in pool.groups] == [0, 4, 1, 5]
    blocks = [ask["partial"].block(a, b, n=G) for a, b in prompt_blocks(4, 2)]
    assert [block.groups for block in blocks] == [[0, 4], [1, 5]]
    assert [[len(c) for c in block.so_far.completion_ids] for block in blocks] == [[3, 3, 0, 0]] * 2
    assert [block.need for block in blocks] == [1, 1]
    # Groups 4, 1 and 5 finish: the oldest two (1, 4) train, in the run's order, whatever their places.
    prompts, batch = buffer.take(pool, _answer(ask["partial"], version=1, grow={b: 1 for b in range(8)},
                                               done={2, 3, 4, 5, 6, 7}))
    assert [p.target for p in prompts] == [11, 14] and batch.completion_ids == [[4] * 4, [5] * 4, [2], [3]]
    assert [g.number for g in buffer.groups] == [0, 5]


def test_more_due_groups_than_a_step_trains_are_dropped_and_counted():
    buffer = UnfinishedBuffer(_cfg(prompts=1, over=2))
    pool, ask = buffer.request(0, _prompts(10, 11, 12), seed=0)
    # Group 0 finishes; groups 1 and 2 are cut after a token each.
    prompts, _ = buffer.take(pool, _answer(ask["partial"], version=0, grow={b: 1 for b in range(6)}, done={0, 1}))
    assert [p.target for p in prompts] == [10]
    pool, ask = buffer.request(1, _prompts(13), seed=0)
    assert ask["partial"].due == [True, True, False]
    # Both due groups finish, one step takes one: the other is dropped (its tokens would pass the bound).
    prompts, _ = buffer.take(pool, _answer(ask["partial"], version=1, grow={b: 1 for b in range(4)},
                                           done={0, 1, 2, 3}))
    assert [p.target for p in prompts] == [11]
    assert buffer.stats["partial_dropped_samples"] == G and [g.number for g in buffer.groups] == [3]


def test_a_carried_group_already_past_the_bound_is_dropped_when_the_request_is_built():
    buffer = UnfinishedBuffer(_cfg(prompts=1, over=1))
    pool, ask = buffer.request(0, _prompts(10, 11), seed=0)
    buffer.take(pool, _answer(ask["partial"], version=0, grow={0: 1, 1: 1, 2: 1}, done={0, 1}))
    # Resumed three steps later under the same bound: group 1 (version 0) is 3 > 1 versions old at request 3.
    pool, ask = buffer.request(3, _prompts(12), seed=0)
    assert [g.number for g in pool.groups] == [2] and pool.dropped_samples == G


def test_the_buffer_round_trips_through_a_checkpoint_pickle():
    buffer = UnfinishedBuffer(_cfg())
    pool, ask = buffer.request(0, _prompts(10, 11, 12), seed=0)
    buffer.take(pool, _answer(ask["partial"], version=0, grow={b: 2 for b in range(6)}, done={0, 1, 2, 3}))
    again = UnfinishedBuffer(_cfg())
    again.load_state_dict(pickle.loads(pickle.dumps(buffer.state_dict())))
    a, b = buffer.request(1, _prompts(13), seed=0)[1], again.request(1, _prompts(13), seed=0)[1]
    assert pickle.dumps(a) == pickle.dumps(b)


def test_a_multi_turn_task_is_refused_in_one_line_naming_the_field():
    from torchtitan_rl.grpo.tasks.base import Task
    from torchtitan_rl.rollout.queue import RolloutQueue

    class Episodes(Task):  # plays whole episodes in its own submit, as tasks/episodes.py's do
        tokenizer, eos_id, pad_id = None, 0, 0
        sample_prompts = reward = describe = lambda *a, **k: None

        def submit(self, generator, prompts, **kwargs):
            raise AssertionError("not reached")

    for field in ("grpo.partial.enable", "generator.stream_groups"):
        cfg = _cfg()
        cfg.grpo.partial.enable = field == "grpo.partial.enable"
        cfg.generator.stream_groups = field == "generator.stream_groups"
        with pytest.raises(ValueError, match=rf"^{field}: task Episodes plays multi-turn episodes"):
            RolloutQueue(cfg, generator=None, task=Episodes())
