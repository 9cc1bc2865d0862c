"""generator.compile: vLLM torch.compiles our model class, and the compiled model still reads the tensors
the sync writes in place."""

import copy
import json

import pytest
import torch

from tests.helpers import PROMPTS, assert_serves, make_generator, native_state, trainer_model
from torchtitan_rl.config import GeneratorConfig, WeightSyncConfig
from torchtitan_rl.engine.compile_cache import cached_model_folder
from torchtitan_rl.models.families import resolve_shape
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


def test_the_compile_cache_keeps_one_folder_per_shape_and_device(tmp_path, monkeypatch):
    """Inductor's code names its GPU: a colocated engine on GPU 1 must not find the decoder compiled on GPU 0 (it ran
    GPU 0's kernels and stopped with "CUDA driver error: invalid argument"); the same shape on the same device finds
    its folder again, config.json written once."""
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    shape = resolve_shape(flavor="debugmodel", hf_checkpoint=None, vocab_size=0, max_seq_len=64)
    gpu0 = cached_model_folder(str(tmp_path), shape, device=torch.device("cuda:0"))
    gpu1 = cached_model_folder(str(tmp_path), shape, device=torch.device("cuda:1"))
    cpu = cached_model_folder(str(tmp_path), shape, device=torch.device("cpu"))
    assert len({gpu0, gpu1, cpu}) == 3 and gpu0.parent == gpu1.parent == cpu.parent == tmp_path / "models"
    assert cached_model_folder(str(tmp_path), shape, device=torch.device("cuda:1")) == gpu1
    assert json.loads((gpu1 / "config.json").read_text()) == shape.to_hf_config()
    assert [p.name for p in gpu1.iterdir()] == ["config.json"]
    other = resolve_shape(flavor="debugmodel_moe", hf_checkpoint=None, vocab_size=0, max_seq_len=64)
    assert cached_model_folder(str(tmp_path), other, device=torch.device("cuda:1")) != gpu1
