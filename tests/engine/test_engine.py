"""The generator's contract: nothing is served before the trainer's weights arrive."""

import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import (
    PROMPTS,
    assert_serves,
    logprob_check,
    make_generator,
    native_state,
    sync_model,
    tiny_shape,
    trainer_model,
)
from torchtitan_rl import compat
from torchtitan_rl.config import WeightSyncConfig
from torchtitan_rl.engine.engine import WeightsNotSyncedError
from torchtitan_rl.rollout.base import Rollouts, prompt_blocks
from torchtitan_rl.weight_sync.sync import WeightSync


@pytest.fixture(scope="module")
def unsynced(tmp_path_factory):
    return make_generator(tmp_path_factory.mktemp("gen"), wait_for_weights_s=0.0)


def test_generate_before_first_sync_raises(unsynced):
    assert unsynced.weight_version is None
    with pytest.raises(WeightsNotSyncedError, match="no weights synced yet"):
        unsynced.generate(PROMPTS, n=2)


def test_dummy_weights_are_poisoned_until_the_first_sync(unsynced):
    assert all(torch.isnan(d.view).all() for d in unsynced.model.sync_targets().values())


@pytest.mark.bf16_numerics
def test_generate_waits_for_the_first_sync_when_configured(unsynced):
    model = trainer_model(seed=1)
    ws = WeightSync(WeightSyncConfig(), reference=native_state(model), generator=unsynced)
    unsynced.config.wait_for_weights_s = 30.0
    timer = threading.Timer(0.5, lambda: ws.sync(native_state(model), version=1))
    started = time.monotonic()
    timer.start()
    rollouts = unsynced.generate(PROMPTS, n=2, seed=0)
    assert time.monotonic() - started >= 0.4
    assert rollouts.weight_version == 1
    assert_serves(rollouts, model)


def test_rollouts_are_group_contiguous_and_record_their_version(unsynced):
    r = unsynced.generate(PROMPTS, n=3, seed=1)
    assert r.prompt_ids == [p for p in PROMPTS for _ in range(3)]
    assert len(r.completion_ids) == len(r.logprobs) == 9
    assert all(len(c) == len(lp) == unsynced.config.sampling.max_tokens for c, lp in zip(r.completion_ids, r.logprobs))
    assert r.weight_version == unsynced.weight_version


def test_same_seed_gives_same_rollouts(unsynced):
    a = unsynced.generate(PROMPTS, n=2, seed=7)
    b = unsynced.generate(PROMPTS, n=2, seed=7)
    assert a.completion_ids == b.completion_ids


@pytest.mark.bf16_numerics  # rows of other batch shapes round alike: checked on AVX2 kernels too (test_cpu_kernels)
def test_prompt_blocks_seeded_by_their_global_index_sample_the_whole_batch(unsynced):
    # What R generator replicas do with one request: each samples a contiguous block, seeded from its
    # first prompt's index in the request; the blocks in order are the batch one engine samples.
    assert prompt_blocks(5, 2) == [(0, 3), (3, 5)] and prompt_blocks(1, 3) == [(0, 1), (1, 1), (1, 1)]
    whole = unsynced.generate(PROMPTS, n=2, seed=7)
    parts = [unsynced.generate(PROMPTS[a:b], n=2, seed=7, first_prompt=a) for a, b in prompt_blocks(len(PROMPTS), 2)]
    joined = Rollouts.concat(parts)
    assert joined.prompt_ids == whole.prompt_ids and joined.completion_ids == whole.completion_ids
    assert joined.weight_version == whole.weight_version
    # Without the offset the second block would draw the first prompts' seeds: other samples.
    assert unsynced.generate(PROMPTS[2:], n=2, seed=7).completion_ids != whole.completion_ids[4:]


@pytest.mark.bf16_numerics
def test_standalone_rollouts_from_a_local_hf_checkpoint(tmp_path):
    """Opt-in debugging path: load_format='auto' serves a checkpoint with no trainer."""
    from torchtitan_rl.config import GeneratorConfig, ModelConfig
    from torchtitan_rl.engine.engine import Engine
    from torchtitan_rl.models.families import to_hf

    model = trainer_model(seed=3)
    shape = tiny_shape()
    ckpt = tmp_path / "hf"
    ckpt.mkdir()
    hf_state = to_hf(model.state_dict(), shape)
    save_file({k: v.contiguous().bfloat16() for k, v in hf_state.items()}, ckpt / "model.safetensors")
    (ckpt / "config.json").write_text(json.dumps(shape.to_hf_config()))

    gen = Engine(
        GeneratorConfig(load_format="auto"),
        model_config=ModelConfig(hf_checkpoint=str(ckpt)),
        shape=shape, seed=0, device="cpu", workdir=tmp_path,
    )
    assert gen.weight_version == 0
    assert_serves(gen.generate(PROMPTS, n=2, seed=0), model)


def test_generate_during_a_sync_waits_for_it_even_without_a_wait_budget(unsynced):
    """The gate: a rollout never mixes two weight versions, and never fails for a sync in flight."""
    unsynced.config.wait_for_weights_s = 0.0
    version = unsynced.weight_version
    assert version is not None
    unsynced.begin_sync()
    threading.Timer(0.5, lambda: unsynced.finish_sync(version + 1)).start()
    started = time.monotonic()
    rollouts = unsynced.generate(PROMPTS, n=1, seed=2)
    assert time.monotonic() - started >= 0.4
    assert rollouts.weight_version == version + 1


def test_an_engine_step_in_another_thread_waits_out_a_compile(unsynced):
    """generator.overlap_training: while torch.compile traces in the trainer's thread, torch.fx has patched
    nn.Module.__call__ process-wide; an engine step in the worker thread then was traced into it (an H200 run
    died so). The worker's steps take the lock a compile holds throughout."""
    held = []

    def backend(graph, inputs):  # inside the compile: another thread cannot take the lock
        probe = ThreadPoolExecutor(1)
        held.append(not probe.submit(compat.compile_lock().acquire, blocking=False).result())
        probe.shutdown()
        return graph.forward

    torch.compile(lambda x: x * 2, backend=backend)(torch.ones(3))
    assert held == [True]
    if unsynced.weight_version is None:  # run alone (-k): the tests before it synced this engine
        model = trainer_model(seed=1)
        sync_model(unsynced, model, version=0)
    unsynced.step_lock = compat.compile_lock()
    worker = ThreadPoolExecutor(1)
    try:
        with compat.compile_lock():  # as a compile in this thread holds it
            running = worker.submit(unsynced.generate, PROMPTS, n=1, seed=4)
            time.sleep(1.0)
            assert not running.done()  # its first step waits
        assert running.result(timeout=120).weight_version == unsynced.weight_version
    finally:
        unsynced.step_lock = contextlib.nullcontext()
        worker.shutdown()


@pytest.mark.slow  # an engine of its own: the interrupted generate leaves its requests in it
def test_a_generate_in_another_thread_stops_at_its_next_step_when_the_engine_closes(tmp_path):
    # ColocatedGenerator.close with generator.overlap_training: the worker's generate ends at once, not after its
    # samples (minutes on the long tail), then the engine shuts down.
    engine = make_generator(tmp_path)
    model = trainer_model(seed=1)
    sync_model(engine, model, version=0)
    engine.step_lock = threading.Lock()
    worker = ThreadPoolExecutor(1)
    with engine.step_lock:  # the generate waits at its first step
        running = worker.submit(engine.generate, PROMPTS, n=4, seed=5)
        time.sleep(0.5)
        engine.interrupt()
    with pytest.raises(RuntimeError, match="generator: closed while a generate ran"):
        running.result(timeout=60)
    worker.shutdown()
    engine.close()


def test_rollouts_report_engine_time_and_the_idle_time_before_them(unsynced):
    unsynced.generate(PROMPTS, n=1, seed=3)
    time.sleep(0.5)  # nothing to do
    idle = unsynced.generate(PROMPTS, n=1, seed=3)
    version = unsynced.weight_version
    unsynced.begin_sync()
    time.sleep(0.5)  # applying a sync is work, not idleness
    unsynced.finish_sync(version)
    after_sync = unsynced.generate(PROMPTS, n=1, seed=3)
    assert idle.idle_s >= 0.5 and idle.generate_s > 0
    # Only the moments around the sync call count (microseconds; the bound is the sync's 0.5 s).
    assert after_sync.idle_s < 0.5, after_sync.idle_s


@pytest.mark.bf16_numerics
def test_an_engine_built_after_its_process_group_was_destroyed_builds_its_own_groups(tmp_path):
    """A finished run destroys the default process group, which vLLM's kept groups were built over
    (simple_grpo.main, called in-process by tests and notebooks): the next engine in the process must
    not reuse them ("Process group ... is not initialized in the world group map")."""
    import torch.distributed as dist

    first = make_generator(tmp_path / "a")
    assert dist.is_initialized()
    dist.destroy_process_group()
    second = make_generator(tmp_path / "b")
    model = trainer_model(seed=5)
    sync_model(second, model, version=1)
    assert_serves(second.generate(PROMPTS, n=1, seed=0), model)
    del first


@pytest.mark.slow  # a second engine: ~8 s
@pytest.mark.skipif(not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
                    reason="vLLM's CPU backend keeps an fp8 KV cache only with AVX-512 or AMX")
def test_an_fp8_kv_cache_holds_twice_the_tokens_and_serves_the_synced_weights(unsynced, tmp_path):
    """generator.kv_cache_dtype fp8: the same memory holds twice the tokens; the synced weights are what it samples
    from (closer to them than to other weights), with more than bf16's noise, as the keys and values are rounded."""
    gen = make_generator(tmp_path, kv_cache_dtype="fp8", wait_for_weights_s=0.0)
    assert gen.kv_cache_tokens == 2 * unsynced.kv_cache_tokens, (gen.kv_cache_tokens, unsynced.kv_cache_tokens)
    model, other = trainer_model(seed=5), trainer_model(seed=6)
    sync_model(gen, model, version=1)
    rollouts = gen.generate(PROMPTS, n=4, seed=0)
    check, miss = logprob_check(rollouts, model), logprob_check(rollouts, other).error
    assert check.error < miss / 4, (check, miss)
    attn = next(iter(gen.model.model.layers.values())).attention.inner_attention.attn
    assert attn.kv_cache_dtype == "fp8" and attn.kv_cache[0].element_size() == 1  # what vLLM allocated


def test_a_gpu_attention_backend_on_a_cpu_engine_is_refused_in_one_line(tmp_path):
    """generator.attention_backend picks a GPU engine's kernels: a CPU engine says so before vLLM builds anything."""
    with pytest.raises(ValueError, match=r"^generator.attention_backend: 'TRITON_ATTN' picks a GPU engine's kernels; "
                                         r"vLLM's CPU backend has its own: set it to 'auto'$"):
        make_generator(tmp_path, attention_backend="TRITON_ATTN")
