"""The rollout server's engine loop under async scheduling: a sync starts with no iteration in flight."""

import torch

from tests.helpers import PROMPTS, make_generator, sync_model, trainer_model
from torchtitan_rl import compat
from torchtitan_rl.engine.engine import sample_seed, sampling_params
from torchtitan_rl.serving.engine_loop import EngineLoop


def test_begin_sync_returns_with_no_iteration_in_flight(tmp_path):
    # Built under one OpenMP thread (as after a batch-invariant run in the same process), while a new thread starts
    # with the machine's count: the engine thread must compute with the engine's.
    threads = torch.get_num_threads()
    compat.set_num_threads(1)
    try:
        _begin_sync_drains(tmp_path)
    finally:
        compat.set_num_threads(threads)


def _begin_sync_drains(tmp_path):
    gen = make_generator(tmp_path, async_scheduling=True)
    model = trainer_model(seed=1)
    sync_model(gen, model, version=1)
    loop = EngineLoop(gen, sync_wait_s=30.0)
    try:
        params = [sampling_params(gen.config.sampling, stop_token_ids=[3, 7], seed=sample_seed(5, i, 0))
                  for i in range(len(PROMPTS))]
        samples = [f.result(timeout=60) for f in loop.submit(PROMPTS, params)]
        assert all(s.weight_version == 1 for s in samples)
        loop.begin_sync()  # the receiver's hook: it writes weights as soon as this returns
        assert not compat.batches_in_flight(gen.engine)
        loop.finish_sync(1)
        loop.resume(published_by=None)
    finally:
        loop.close()
