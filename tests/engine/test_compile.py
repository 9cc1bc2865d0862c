"""generator.compile: vLLM torch.compiles our model class, and the compiled model still reads the tensors
the sync writes in place."""

import copy

import pytest
import torch

from tests.helpers import PROMPTS, assert_serves, make_generator, native_state, trainer_model
from torchtitan_rl.config import GeneratorConfig, WeightSyncConfig
from torchtitan_rl.weight_sync.sync import WeightSync


def test_compile_needs_cuda_graphs_or_compiled_mode_not_eager():
    with pytest.raises(ValueError, match=r"generator.compile: needs generator.enforce_eager false"):
        GeneratorConfig(compile=True, enforce_eager=True).check("generator")


@pytest.mark.slow  # ~60 s on 2 cores: inductor compiles the model for the CPU
@pytest.mark.bf16_numerics
def test_compiled_generator_serves_each_sync_including_a_one_weight_change(tmp_path):
    gen = make_generator(tmp_path, compile=True, enforce_eager=False)
    model = trainer_model(seed=1)
    ws = WeightSync(WeightSyncConfig(), reference=native_state(model), generator=gen)
    ws.sync(native_state(model), version=1)
    before = gen.generate(PROMPTS, n=2, seed=3)
    assert not gen.model.do_not_compile and gen.model.compiled  # vLLM's compiled forward ran
    assert_serves(before, model)

    changed = copy.deepcopy(model)
    with torch.no_grad():  # one tensor: the first block's MLP input projection
        w = changed.layers["0"].feed_forward.w1.weight
        w.copy_(torch.randn_like(w) * w.std() * 3)
    ws.sync(native_state(changed), version=2)
    after = gen.generate(PROMPTS, n=2, seed=3)
    assert after.logprobs != before.logprobs
    assert_serves(after, changed, not_=[model])
