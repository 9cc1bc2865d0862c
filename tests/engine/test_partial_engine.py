"""Partial rollouts and in-flight updates in the engine: a sample cut under one weight version goes on under the
next, and every token keeps the version (and the generator logprob) it was sampled with, into the loss.

The real engine on the tiny Qwen3; two trainer models of other seeds stand for two weight versions, far apart
(their logprobs of the same tokens differ by ~1 nat), so a token scored by the wrong version cannot hide.
"""

import pytest
import torch

from tests.helpers import NOISE_FACTOR, PROMPTS, SEPARATION, make_generator, native_state, reference_logprobs, \
    trainer_model
from torchtitan_rl import compat
from torchtitan_rl.config import GeneratorConfig, HarnessLengthsConfig, ModelConfig, WeightSyncConfig
from torchtitan_rl.engine.engine import Engine, continue_seed, sample_seed
from torchtitan_rl.engine.lengths import response_length
from torchtitan_rl.engine.rollouts import PartialRequest, Rollouts, SyncPoint
from torchtitan_rl.grpo.batch import pack_rollouts, pack_versions
from torchtitan_rl.grpo.loss import importance_weights
from torchtitan_rl.models.families import resolve_shape
from torchtitan_rl.models.shape import build_titan_model
from torchtitan_rl.weight_sync.sync import WeightSync

MAX_TOKENS = 8
LONG = 136
LONG_PROMPTS = [[1] + [(7 * i + 3 * p) % 13 + 2 for i in range(LONG - 1)] for p in range(2)]
"""Prompts longer than one KV block (vLLM caches whole blocks: 128 tokens on CPU)."""


@pytest.fixture(scope="module")
def models():
    return trainer_model(seed=1), trainer_model(seed=2)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, models):
    """A generator (async scheduling on, as by default) serving models[0] as version 0."""
    gen = make_generator(tmp_path_factory.mktemp("partial"))
    sync = WeightSync(WeightSyncConfig(), reference=native_state(models[0]), generator=gen)
    sync.sync(native_state(models[0]), version=0)
    gen.test_sync = sync
    return gen


def _new(prompts: list[list[int]], n: int) -> Rollouts:
    """Unstarted samples, as rollout/partial.py asks for new groups."""
    B = len(prompts) * n
    return Rollouts([list(p) for p in prompts for _ in range(n)], [[] for _ in range(B)], [[] for _ in range(B)],
                    weight_version=-1, versions=[[] for _ in range(B)], finished=[False] * B)


def _segment_errors(model, prompt: list[int], completion: list[int], logprobs: list[float]):
    """|generator - exact| logprob per token under ``model``, and the mean bf16 noise of that model here."""
    exact = reference_logprobs(model, prompt, completion, dtype=torch.float32)
    noise = (reference_logprobs(model, prompt, completion) - exact).abs().mean().item()
    return (torch.tensor(logprobs) - exact).abs(), exact, NOISE_FACTOR * max(noise, 1e-5)


def test_a_cut_sample_continues_under_the_next_weights_and_each_token_keeps_its_version_into_the_loss(engine, models):
    a, b = models
    prompt = PROMPTS[0]
    # Version 0: stop after 3 sampled tokens (no group needs finishing).
    first = engine.generate([prompt], n=1, seed=11, partial=PartialRequest(
        so_far=_new([prompt], 1), groups=[5], need=0, due=[False], token_budget=3))
    k = len(first.completion_ids[0])
    assert first.finished == [False] and 3 <= k < MAX_TOKENS
    assert first.versions == [[0] * k]
    # Version 1 (other weights); the cut sample goes on as prompt + its k tokens and runs to its end.
    engine.test_sync.sync(native_state(b), version=1)
    whole = engine.generate([prompt], n=1, seed=11, partial=PartialRequest(
        so_far=first, groups=[5], need=1, due=[False]))
    completion, lps = whole.completion_ids[0], whole.logprobs[0]
    assert whole.finished == [True] and len(completion) == MAX_TOKENS and whole.weight_version == 1
    assert completion[:k] == first.completion_ids[0] and lps[:k] == first.logprobs[0]
    assert whole.versions == [[0] * k + [1] * (MAX_TOKENS - k)]
    # The generator logprobs are each token's own sampler's: the first k version 0's, the rest version 1's.
    err_a, exact_a, tol_a = _segment_errors(a, prompt, completion, lps)
    err_b, exact_b, tol_b = _segment_errors(b, prompt, completion, lps)
    assert err_a[:k].mean() <= tol_a and err_b[:k].mean() > SEPARATION * tol_b
    assert err_b[k:].mean() <= tol_b and err_a[k:].mean() > SEPARATION * tol_a

    # Into the batch and the loss: pi_old is version 1 (the trainer that trains this step); rho is per token.
    tokens_BL, mask_BL, gen_BL = pack_rollouts(whole.prompt_ids, whole.completion_ids, whole.logprobs, pad_id=0)
    versions_BL = pack_versions(whole.prompt_ids, whole.versions, length=tokens_BL.shape[1])
    scored = mask_BL[0].bool()
    assert versions_BL[0, scored].tolist() == [0] * k + [1] * (MAX_TOKENS - k)
    old_BL = torch.zeros_like(gen_BL)
    old_BL[0, scored] = exact_b
    weights_BL, stats = importance_weights(old_BL, gen_BL, mask_BL, mode="truncate", cap=1e6,
                                           ages_BT=1 - versions_BL, max_age=1)
    log_w = weights_BL[0, scored].log()
    # Tokens of version 0 get pi_1 / pi_0, the ones of version 1 ~1: a correction that took one version's
    # logprobs for the whole sequence would give one of the two segments the other's weights.
    torch.testing.assert_close(log_w[:k], (exact_b - exact_a)[:k].float(), atol=2 * tol_a, rtol=0)
    assert (log_w[:k] - 0).abs().mean() > SEPARATION * tol_b and log_w[k:].abs().mean() <= tol_b
    assert stats["version_age_1_frac"] == pytest.approx(k / MAX_TOKENS)
    assert stats["version_age_0_frac"] == pytest.approx(1 - k / MAX_TOKENS)
    engine.test_sync.sync(native_state(a), version=2)  # leave the module's engine on version 0's weights


def test_the_stop_rule_waits_for_the_needed_and_due_groups_and_cut_samples_finish_at_their_drawn_length(engine):
    lengths = HarnessLengthsConfig(distribution="lognormal", median=3, p90=6)
    prompts, n, groups, seed = PROMPTS, 2, [7, 8, 9], 3
    target = [[response_length(lengths, cap=MAX_TOKENS, seed=seed, prompt=g, sample=j) for j in range(n)]
              for g in groups]
    first = engine.generate(prompts, n=n, seed=seed, lengths=lengths, partial=PartialRequest(
        so_far=_new(prompts, n), groups=groups, need=1, due=[False, False, True]))
    ends = [first.finished[i * n:(i + 1) * n] for i in range(3)]
    assert sum(all(e) for e in ends) >= 1 and all(ends[2])  # one group done, and the due one
    for i, g in enumerate(target):
        for j, t in enumerate(g):
            c = first.completion_ids[i * n + j]
            assert len(c) == t if first.finished[i * n + j] else len(c) < t
    assert not all(first.finished), "a sample left to cut (the lengths drawn for seed 3 differ)"
    # The engine steps after the needed group finished ran for the due one (a token a step each; async scheduling
    # adds the batch in flight when the request stops): the trace counts them.
    late = engine.generate(prompts, n=n, seed=seed, lengths=lengths, partial=PartialRequest(
        so_far=_new(prompts, n), groups=groups, need=1, due=[False, True, False]))
    need_at = min(max(g) for g in target)  # the decode step that finishes the first group
    for out, due in ((first, 2), (late, 1)):
        extra = max(target[due]) - need_at
        assert extra <= out.trace.after_need_iterations <= extra + 2, (target, due, out.trace)
        assert out.trace.metrics()["gen_after_need_s"] == out.trace.after_need_s > 0
    assert late.trace.after_need_iterations - first.trace.after_need_iterations == max(target[1]) - max(target[2])
    # Continued, every cut sample runs to the length drawn for it: its identity (group, sample) is kept.
    rest = engine.generate(prompts, n=n, seed=seed, lengths=lengths, partial=PartialRequest(
        so_far=first, groups=groups, need=3, due=[False] * 3))
    assert all(rest.finished) and [len(c) for c in rest.completion_ids] == [t for g in target for t in g]
    # The same request again samples the same tokens (seeded per group and sample, continuations too).
    again = engine.generate(prompts, n=n, seed=seed, lengths=lengths, partial=PartialRequest(
        so_far=_new(prompts, n), groups=groups, need=1, due=[False, False, True]))
    assert again.completion_ids == first.completion_ids and again.finished == first.finished
    assert continue_seed(seed, 7, 0, 2) not in (sample_seed(seed, 7, 0), continue_seed(seed, 7, 0, 3))


def test_a_request_whose_groups_are_already_done_samples_nothing(engine):
    done = engine.generate(PROMPTS[:1], n=2, seed=1)
    so_far = Rollouts(done.prompt_ids + _new(PROMPTS[1:2], 2).prompt_ids, done.completion_ids + [[], []],
                      done.logprobs + [[], []], weight_version=-1, versions=[[0] * len(c) for c in done.completion_ids]
                      + [[], []], finished=[True, True, False, False])
    out = engine.generate(PROMPTS[:2], n=2, seed=1, partial=PartialRequest(so_far=so_far, groups=[0, 1], need=1,
                                                                            due=[False, False]))
    assert out.completion_ids == done.completion_ids + [[], []] and out.finished == [True, True, False, False]
    assert out.trace.iterations == 0


@pytest.fixture(scope="module", params=[False, True], ids=["async_off", "async_on"])
def inflight(request, tmp_path_factory):
    """An engine with in-flight updates, async scheduling off and on, whose contexts hold a whole KV block of
    prompt (vLLM's CPU block is 128 tokens, and only whole blocks are cached), serving version 0; two models."""
    shape = resolve_shape(flavor="tiny", hf_checkpoint=None, vocab_size=16, max_seq_len=LONG + 2 * MAX_TOKENS)
    gen = Engine(GeneratorConfig(inflight_updates=True, async_scheduling=request.param,
                                 max_model_len=LONG + MAX_TOKENS),
                 model_config=ModelConfig(), shape=shape, seed=0, device="cpu",
                 workdir=tmp_path_factory.mktemp("inflight"))
    a, b = build_titan_model(shape, seed=1), build_titan_model(shape, seed=2)
    sync = WeightSync(WeightSyncConfig(), reference=native_state(a), generator=gen)
    sync.sync(native_state(a), version=0)
    gen.test_sync = sync
    return gen, a, b, request.param


def test_an_inflight_sync_lands_between_two_iterations_and_later_tokens_carry_the_new_version(inflight):
    inflight, a, b, async_scheduling = inflight
    asked, in_flight_when_due = [], []

    def pending() -> bool:  # due after the third engine step: the prompt's prefill and two decodes
        asked.append(inflight.weight_version)
        due = len(asked) >= 3 and inflight.weight_version == 0
        if due:
            in_flight_when_due.append(compat.batches_in_flight(inflight.engine))
        return due

    def apply() -> None:
        assert not compat.batches_in_flight(inflight.engine)  # no iteration straddles the sync
        inflight.test_sync.sync(native_state(b), version=1)

    out = inflight.generate(LONG_PROMPTS, n=1, seed=4, between_steps=SyncPoint(pending=pending, apply=apply))
    assert out.weight_version == 0 and out.finished is None and asked[:3] == [0, 0, 0] and asked[-1] == 1
    # With async scheduling the next iteration was already scheduled when the sync came due: the engine paused its
    # scheduling, collected that batch, then synced (one step later); without it the step boundary was free.
    assert in_flight_when_due == ([True, False] if async_scheduling else [False])
    for prompt, completion, lps, versions in zip(out.prompt_ids, out.completion_ids, out.logprobs, out.versions):
        k = versions.count(0)
        assert len(completion) == MAX_TOKENS and versions == [0] * k + [1] * (MAX_TOKENS - k) and 0 < k < MAX_TOKENS
        err_a, _, tol_a = _segment_errors(a, prompt, completion, lps)
        err_b, _, tol_b = _segment_errors(b, prompt, completion, lps)
        assert err_a[:k].mean() <= tol_a and err_b[:k].mean() > SEPARATION * tol_b
        # The new weights sample the later tokens (over keys/values the old ones wrote: SEPARATION x, not noise).
        assert err_a[k:].mean() > SEPARATION * tol_a
    # A request made after the sync is served by version 1 alone: the KV blocks version 0 computed for the same
    # prompts are still cached (the running requests held them, so vLLM reset nothing) and must not be reused.
    again = inflight.generate(LONG_PROMPTS, n=1, seed=4)
    assert again.versions == [[1] * MAX_TOKENS] * 2
    for prompt, completion, lps in zip(again.prompt_ids, again.completion_ids, again.logprobs):
        err_b, _, tol_b = _segment_errors(b, prompt, completion, lps)
        assert err_b.mean() <= tol_b


def test_each_group_is_reported_once_as_soon_as_its_samples_finish(engine):
    lengths = HarnessLengthsConfig(distribution="lognormal", median=3, p90=6)
    seen = []
    out = engine.generate(PROMPTS, n=2, seed=3, lengths=lengths, on_group=lambda g, rows: seen.append((g, rows)))
    assert sorted(g for g, _ in seen) == [0, 1, 2]
    for g, rows in seen:  # what the generate returns for them, already
        assert rows.completion_ids == out.completion_ids[2 * g:2 * g + 2] and rows.logprobs == out.logprobs[2 * g:2 * g + 2]
    # In the order the groups finish: by their longest sample.
    longest = [max(len(c) for c in rows.completion_ids) for _, rows in seen]
    assert longest == sorted(longest) and len(set(longest)) > 1
