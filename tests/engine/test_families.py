"""The generator for both families: dummy start + sync serves the trainer's model; load_format=auto the same."""

import pytest
import torch

from tests.helpers import PROMPTS
from tests.models.test_families import LLAMA3_ROPE, _with_config
from torchtitan_rl.config import GeneratorConfig, LoRAConfig, ModelConfig, WeightSyncConfig
from torchtitan_rl.engine.engine import Engine
from torchtitan_rl.models.families import resolve_shape
from torchtitan_rl.models.lora import apply_lora
from torchtitan_rl.models.shape import build_titan_model
from torchtitan_rl.trainer.hf_weights import load_hf_weights
from torchtitan_rl.weight_sync.sync import WeightSync

FAMILIES = ["qwen3", "llama"]

# fp32 generator vs fp32 trainer forward: only vLLM's CPU attention kernel sums
# in another order than SDPA; measured max 3.1e-6. In bf16 these deliberately
# peaky random weights give up to 6e-2 of rounding noise, which would hide a
# small error, so these tests run the model in fp32.
FP32_ATOL = 1e-4


@torch.no_grad()
def max_error_fp32(rollouts, model) -> float:
    """Largest |generator logprob - the trainer model's fp32 logprob| over the rollouts' tokens."""
    worst = 0.0
    for prompt, completion, logprobs in zip(rollouts.prompt_ids, rollouts.completion_ids, rollouts.logprobs):
        tokens = torch.tensor([prompt + completion])
        lp = torch.log_softmax(model(tokens)[0, :-1].float(), -1).gather(-1, tokens[0, 1:, None])[:, 0]
        worst = max(worst, (torch.tensor(logprobs) - lp[len(prompt) - 1 :]).abs().max().item())
    return worst


def trainer_side(folder, *, lora: LoRAConfig | None = None):
    """(shape, the trainer's model with the folder's weights, fp32) and, with LoRA, a non-zero adapter."""
    shape = resolve_shape(flavor="tiny", hf_checkpoint=str(folder), vocab_size=0, max_seq_len=64)
    model = build_titan_model(shape, seed=0)
    load_hf_weights(model, shape=shape, hf_dir=folder)
    if lora is not None:
        torch.manual_seed(1)
        apply_lora(model, lora)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("lora_b"):
                    p.normal_(0, 0.3)  # B = 0 at init would make the adapter invisible
    return shape, model


def state_of(model):
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def generator(folder, shape, tmp_path, **config):
    lora = config.pop("lora", LoRAConfig())
    batch_invariant = config.pop("batch_invariant", False)
    dtype = "bfloat16" if batch_invariant else "float32"  # batch-invariant mode is bf16 only
    return Engine(
        GeneratorConfig(**config), model_config=ModelConfig(hf_checkpoint=str(folder), lora=lora, dtype=dtype),
        shape=shape, seed=0, device="cpu", workdir=tmp_path, batch_invariant=batch_invariant,
    )


@pytest.mark.parametrize("family", [*FAMILIES, "llama3-rope"])
def test_dummy_start_and_sync_then_auto_load_serve_the_trainer_model(family, tiny_hf_checkpoint, tmp_path):
    if family == "llama3-rope":  # Llama 3.1's RoPE scaling: vLLM must build the same scaled cache
        folder = _with_config(tiny_hf_checkpoint, tmp_path, rope_parameters=LLAMA3_ROPE)
    else:
        folder = tiny_hf_checkpoint(family)
    shape, model = trainer_side(folder)

    gen = generator(folder, shape, tmp_path / "dummy")
    try:
        assert all(torch.isnan(d.view).all() for d in gen.model.sync_targets().values())  # the gate's poison
        WeightSync(WeightSyncConfig(verify="full"), reference=state_of(model), generator=gen).sync(
            state_of(model), version=1
        )
        synced = gen.generate(PROMPTS, n=2, seed=0)
    finally:
        gen.close()
    assert max_error_fp32(synced, model) < FP32_ATOL

    gen = generator(folder, shape, tmp_path / "auto", load_format="auto")
    try:
        loaded = gen.generate(PROMPTS, n=2, seed=0)
    finally:
        gen.close()
    # The same weights (the checkpoint's, by vLLM's loader or by the sync's copy)
    # and the same fp32 RoPE cache: the same samples with the same logprobs.
    assert loaded.completion_ids == synced.completion_ids
    assert loaded.logprobs == synced.logprobs


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_llama_lora_sync_serves_the_adapted_model(sync, tiny_hf_checkpoint, tmp_path):
    folder = tiny_hf_checkpoint("llama")
    lora = LoRAConfig(rank=2, sync=sync)
    shape, model = trainer_side(folder, lora=lora)
    gen = generator(folder, shape, tmp_path, lora=lora)
    try:
        ws = WeightSync(WeightSyncConfig(verify="full"), reference=state_of(model), generator=gen, lora=lora)
        ws.sync(state_of(model), version=1)
        rollouts = gen.generate(PROMPTS, n=2, seed=0)
    finally:
        gen.close()
    assert max_error_fp32(rollouts, model) < FP32_ATOL


def test_llama_batch_invariant_generator_equals_trainer_bitwise(tiny_hf_checkpoint, tmp_path):
    """CPU batch-invariant kernels on a model without QK-norm: the trainer's recompute has the sampled bits."""
    from torchtitan_rl.config.job_config import TrainerConfig
    from torchtitan_rl.grpo.batch import pack_rollouts
    from torchtitan_rl.trainer import Trainer

    folder = tiny_hf_checkpoint("llama")
    shape = resolve_shape(flavor="tiny", hf_checkpoint=str(folder), vocab_size=0, max_seq_len=64)
    trainer = Trainer(TrainerConfig(), model_config=ModelConfig(hf_checkpoint=str(folder)), shape=shape, seed=0,
                      device=torch.device("cpu"), output_dir=tmp_path, batch_invariant=True)
    gen = generator(folder, shape, tmp_path / "gen", batch_invariant=True)
    try:
        WeightSync(WeightSyncConfig(), reference=trainer.sync_state(), generator=gen).sync(
            trainer.sync_state(), version=1
        )
        rollouts = gen.generate(PROMPTS, n=4, seed=0)
    finally:
        gen.close()
    tokens_BL, mask_BL, gen_lp_BL = pack_rollouts(rollouts.prompt_ids, rollouts.completion_ids, rollouts.logprobs,
                                                  pad_id=0)
    trainer_lp_BL = trainer.token_logprobs(tokens_BL, temperature=1.0)
    scored = mask_BL.bool()
    assert torch.equal(trainer_lp_BL[scored], gen_lp_BL[scored])
