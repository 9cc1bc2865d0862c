"""The colocated sync, proven by what the real vLLM engine computes afterwards."""

import pytest
import torch

from tests.helpers import PROMPTS, assert_serves, checkpoint_state, make_generator, native_state, trainer_model
from torchtitan_rl.config import WeightSyncConfig
from torchtitan_rl.weight_sync.sync import WeightSync

pytestmark = pytest.mark.bf16_numerics


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    return make_generator(tmp_path_factory.mktemp("gen"))


def _sync(generator, state, version, **cfg):
    ws = WeightSync(WeightSyncConfig(**cfg), reference=state, generator=generator)
    return ws, ws.sync(state, version=version)


def test_logprobs_match_trainer_for_two_weight_sets_in_a_row(generator):
    first, second = trainer_model(seed=1), trainer_model(seed=2)
    _sync(generator, native_state(first), 1)
    r1 = generator.generate(PROMPTS, n=2, seed=0)
    assert r1.weight_version == 1
    assert_serves(r1, first)

    # Same prompts again: a stale prefix-cache entry or a partial write would show here.
    _sync(generator, checkpoint_state(second), 2)
    r2 = generator.generate(PROMPTS, n=2, seed=0)
    assert r2.weight_version == 2
    assert_serves(r2, second, not_=[first])


def test_bf16_source_is_accepted_and_matches(generator):
    model = trainer_model(seed=3)
    bf16_state = {k: v.detach().bfloat16() if v.dtype == torch.float32 and "rope" not in k else v
                  for k, v in native_state(model).items()}
    _sync(generator, bf16_state, 3)
    assert_serves(generator.generate(PROMPTS[:1], n=2, seed=1), model)


def test_rope_buffer_is_carried_by_the_sync(generator):
    model = trainer_model(seed=4)
    state = native_state(model)
    _sync(generator, state, 4)
    rope_key = next(k for k in state if k.endswith("rope.cache"))
    gen_rope = generator.model.all_tensors()[rope_key]
    assert torch.equal(gen_rope, state[rope_key])
    # Change only the trainer's buffer: the generator must follow it.
    with torch.no_grad():
        for k in state:
            if k.endswith("rope.cache"):
                state[k].mul_(0.5)
    _sync(generator, state, 5)
    assert_serves(generator.generate(PROMPTS, n=1, seed=2), model)
    assert torch.equal(gen_rope, state[rope_key])


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda s: s.pop("norm.weight"), "missing ['norm.weight']"),
        (lambda s: s.__setitem__("extra.weight", torch.zeros(3)), "unexpected ['extra.weight']"),
        (lambda s: s.__setitem__("norm.weight", torch.ones(65)), "norm.weight (65,) != (64,)"),
        (lambda s: s["layers.1.feed_forward.w2.weight"].view(-1)[7].fill_(float("nan")),
         "layers.1.feed_forward.w2.weight"),
        (lambda s: s["tok_embeddings.weight"].view(-1)[0].fill_(float("inf")), "tok_embeddings.weight"),
    ],
    ids=["missing", "extra", "shape", "nan", "inf"],
)
def test_bad_state_dict_is_rejected_and_previous_weights_kept(generator, corrupt, message):
    good = trainer_model(seed=6)
    ws, _ = _sync(generator, native_state(good), 6)
    before = generator.generate(PROMPTS, n=1, seed=3)

    bad = {k: v.detach().clone() for k, v in native_state(trainer_model(seed=7)).items()}
    corrupt(bad)
    with pytest.raises(ValueError) as err:
        ws.sync(bad, version=7)
    assert message in str(err.value)

    assert generator.weight_version == 6
    after = generator.generate(PROMPTS, n=1, seed=3)
    assert after.completion_ids == before.completion_ids
    assert_serves(after, good)


def test_tied_embedding_is_written_once_and_both_names_accepted(generator):
    model = trainer_model(seed=8)
    state = checkpoint_state(model)  # has both tok_embeddings.weight and lm_head.weight
    assert state["lm_head.weight"].data_ptr() == state["tok_embeddings.weight"].data_ptr()
    ws, stats = _sync(generator, state, 8)
    assert ws.plan.aliases == {"lm_head.weight": "tok_embeddings.weight"}
    assert_serves(generator.generate(PROMPTS, n=1, seed=4), model)


def test_full_verification_catches_a_write_that_did_not_land(generator, monkeypatch):
    model = trainer_model(seed=9)
    state = native_state(model)
    ws = WeightSync(WeightSyncConfig(verify="full"), reference=state, generator=generator)
    real_copy = torch._foreach_copy_

    def lossy_copy(dests, srcs):
        real_copy(dests[1:], srcs[1:])  # drops the first tensor of every bucket

    monkeypatch.setattr(torch, "_foreach_copy_", lossy_copy)
    with pytest.raises(RuntimeError, match="did not arrive"):
        ws.sync(state, version=9)
    monkeypatch.undo()
    # Half-written weights are never served.
    assert generator.weight_version is None
    with pytest.raises(RuntimeError, match="no weights synced"):
        generator.generate(PROMPTS, n=1)
    ws.sync(state, version=10)
    assert_serves(generator.generate(PROMPTS, n=1, seed=5), model)


def test_sampled_verification_covers_every_tensor_over_successive_syncs(generator):
    state = native_state(trainer_model(seed=10))
    ws = WeightSync(WeightSyncConfig(verify="sampled", verify_samples=3), reference=state, generator=generator)
    from torchtitan_rl.weight_sync.verify import pick_entries

    seen = set()
    for version in range(len(ws.keys)):
        seen |= pick_entries(ws.keys, "sampled", 3, version)
    assert seen == set(ws.keys)
    assert ws.sync(state, version=11).tensors_verified == 3 + len(ws.plan.constants)


def test_huge_but_finite_values_are_not_mistaken_for_nan(generator):
    """The NaN scan is a max-|x| pass: huge finite values (an L2 norm would overflow) pass."""
    state = {k: v.detach().clone() for k, v in native_state(trainer_model(seed=12)).items()}
    state["norm.weight"].fill_(1e30)
    ws = WeightSync(WeightSyncConfig(), reference=state, generator=generator)
    assert ws.sync(state, version=12).version == 12


def test_unchanged_buffers_move_once_and_changed_ones_again(generator):
    model = trainer_model(seed=13)
    state = native_state(model)
    ws = WeightSync(WeightSyncConfig(), reference=state, generator=generator)
    rope = [k for k in state if k.endswith("rope.cache")]
    first = ws.sync(state, version=13)
    second = ws.sync(native_state(model), version=14)  # the same live tensors, untouched
    rope_bytes = sum(state[k].numel() * state[k].element_size() for k in rope)
    assert first.bytes_written - second.bytes_written == rope_bytes
    with torch.no_grad():
        state[rope[0]].mul_(0.5)  # an in-place write bumps the version counter
    third = ws.sync(state, version=15)
    assert third.bytes_written == second.bytes_written + rope_bytes // len(rope)
    assert torch.equal(generator.model.all_tensors()[rope[0]], state[rope[0]])
    assert_serves(generator.generate(PROMPTS, n=1, seed=6), model)


def test_a_state_dict_missing_a_frozen_key_after_a_sync_is_a_value_error_naming_it(generator):
    """The frozen rope cache moved once (``unchanged`` remembers it): its absence is named, not a KeyError."""
    model = trainer_model(seed=17)
    state = native_state(model)
    ws = WeightSync(WeightSyncConfig(), reference=state, generator=generator)
    ws.sync(state, version=17)
    state.pop("layers.0.attention.rope.cache")
    with pytest.raises(ValueError, match=r"missing \['layers.0.attention.rope.cache'\]"):
        ws.sync(state, version=18)
    assert generator.weight_version == 17


def test_a_sync_while_a_request_holds_kv_blocks_fails_and_serves_nothing_rather_than_a_stale_cache(generator):
    """vLLM keeps its prefix cache while any request holds blocks: the sync must not publish over it."""
    from torchtitan_rl.engine.engine import PrefixCacheKept, sampling_params
    from torchtitan_rl.config import SamplingConfig

    model = trainer_model(seed=19)
    _sync(generator, native_state(model), 19)
    engine = generator.engine
    engine.add_request("held", {"prompt_token_ids": PROMPTS[0]},
                       sampling_params(SamplingConfig(max_tokens=16), stop_token_ids=None, seed=0))
    engine.step()  # prefilled: it holds KV blocks
    assert engine.has_unfinished_requests()
    try:
        with pytest.raises(PrefixCacheKept, match="did not reset its prefix cache"):
            _sync(generator, native_state(trainer_model(seed=20)), 20)
        assert generator.weight_version is None  # withdrawn: neither version is served over a stale cache
    finally:
        engine.abort_request(["held"])
    _sync(generator, native_state(model), 21)
    assert_serves(generator.generate(PROMPTS, n=1, seed=7), model)


def test_a_changed_engine_constant_fails_the_sync_by_name(generator):
    """vLLM's KV-cache scales must stay 1; the check reads every element, not only the first."""
    state = native_state(trainer_model(seed=16))
    ws, _ = _sync(generator, state, 16)
    name, (tensor, value) = next(iter(ws.plan.constants.items()))
    flat = tensor.view(-1)
    with torch.no_grad():
        flat[-1] = 2.0
    try:
        with pytest.raises(RuntimeError, match=f"engine-owned tensors changed: .*{name}"):
            ws.sync(state, version=17)
        assert generator.weight_version is None  # it serves nothing rather than a broken engine
    finally:
        with torch.no_grad():
            flat[-1] = value
    assert ws.sync(state, version=18).version == 18
