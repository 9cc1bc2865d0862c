"""generator.async_scheduling: the same samples as without it, and no iteration left running after a generate."""

import pytest

from tests.helpers import PROMPTS, make_generator, sync_model, trainer_model
from torchtitan_rl import compat
from torchtitan_rl.engine.engine import sample_seed, sampling_params


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A generator with async scheduling and one without, both serving the same synced weights."""
    model = trainer_model(seed=1)
    gens = {}
    for on in (True, False):
        gen = make_generator(tmp_path_factory.mktemp(f"async_{on}"), async_scheduling=on)
        sync_model(gen, model, version=1)
        gens[on] = gen
    return gens


def test_the_cpu_engine_really_schedules_asynchronously(engines):
    # vLLM's CPU platform turns it off for every engine; the tests below would prove nothing then.
    assert engines[True].engine.vllm_config.scheduler_config.async_scheduling
    assert engines[True].engine.engine_core.engine_core.batch_queue is not None
    assert not engines[False].engine.vllm_config.scheduler_config.async_scheduling


@pytest.mark.parametrize("stop_token_ids", [None, [3, 7]], ids=["max_tokens", "stop_tokens"])
def test_async_scheduling_samples_the_same_tokens_and_logprobs(engines, stop_token_ids):
    on, off = (engines[k].generate(PROMPTS, n=4, seed=11, stop_token_ids=stop_token_ids) for k in (True, False))
    assert on.completion_ids == off.completion_ids
    assert on.logprobs == off.logprobs  # bitwise: the same kernels on the same batches
    if stop_token_ids:
        assert any(len(c) < engines[True].config.sampling.max_tokens for c in on.completion_ids)


@pytest.mark.parametrize("stop_token_ids", [None, [3, 7]], ids=["max_tokens", "stop_tokens"])
def test_generate_returns_with_no_iteration_in_flight(engines, stop_token_ids):
    """A sync writes the weights right after a generate: an iteration scheduled before the last request
    finished must not still be queued (on a GPU, running) then."""
    gen = engines[True]
    gen.generate(PROMPTS, n=4, seed=12, stop_token_ids=stop_token_ids)
    assert not compat.batches_in_flight(gen.engine)
    assert not gen.engine.engine_core.engine_core.scheduler.has_requests()


def test_flat_logprobs_are_the_logprobs_vllm_reports_per_token(engines):
    """generate reads the sampled token's logprob from vLLM's flat lists; the same seeded request with
    vLLM's per-token dicts (its default) reports the same tokens and the same logprobs, bit for bit."""
    gen = engines[True]
    rollouts = gen.generate(PROMPTS[:1], n=1, seed=13)
    params = sampling_params(gen.config.sampling, stop_token_ids=None, seed=sample_seed(13, 0, 0))
    params.flat_logprobs = False
    gen.engine.add_request("dict-logprobs", {"prompt_token_ids": PROMPTS[0]}, params)
    done = None
    while gen.engine.has_unfinished_requests() or compat.batches_in_flight(gen.engine):
        done = next((o.outputs[0] for o in gen.engine.step() if o.finished), done)
    assert list(done.token_ids) == rollouts.completion_ids[0]
    assert [pos[t].logprob for pos, t in zip(done.logprobs, done.token_ids)] == rollouts.logprobs[0]
