"""Qwen3 MoE through the generator: the sync reaches every expert (coverage proof), the generator serves the
trainer's weights, it hands over its expert choices, and routing replay makes the trainer use them."""

import re

import pytest
import torch

from tests.helpers import PROMPTS, assert_serves, make_generator, tiny_shape
from torchtitan_rl.config import WeightSyncConfig
from torchtitan_rl.models.moe import recorded, routers, routing, synced_state
from torchtitan_rl.models.shape import build_titan_model
from torchtitan_rl.weight_sync.sync import WeightSync

pytestmark = pytest.mark.bf16_numerics


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    return make_generator(tmp_path_factory.mktemp("moe"), flavor="tiny-moe")


def moe_model(seed: int) -> torch.nn.Module:
    """The tiny MoE with its experts 4x their init: at init they move logprobs by ~1e-3, inside bf16 noise,
    so a gate/up or expert mix-up in the generator would go unseen; at 4x the experts decide the logprobs."""
    model = build_titan_model(tiny_shape("tiny-moe"), seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".inner_experts." in name:
                p.mul_(4)
    return model


def _sync(generator, state, version):
    ws = WeightSync(WeightSyncConfig(verify="full"), reference=state, generator=generator)
    ws.sync(state, version=version)
    return ws


def test_sync_then_generator_logprobs_equal_the_trainer_forward(generator):
    first, second = moe_model(seed=1), moe_model(seed=2)
    _sync(generator, synced_state(first), 1)
    assert_serves(generator.generate(PROMPTS, n=2, seed=0), first)
    _sync(generator, synced_state(second), 2)  # every expert moved: the first weights are far away
    assert_serves(generator.generate(PROMPTS, n=2, seed=0), second, not_=[first])


def test_coverage_proof_fails_when_one_expert_tensor_is_left_out(generator):
    state = synced_state(moe_model(seed=3))
    name = "layers.1.moe.routed_experts.inner_experts.w3_EFD"
    with pytest.raises(ValueError, match=r"unwritten: \['layers.1.moe.w13_weight'\]"):
        WeightSync(WeightSyncConfig(), reference={k: v for k, v in state.items() if k != name},
                   generator=generator)


def test_coverage_proof_covers_every_expert_router_and_layout(generator):
    ws = WeightSync(WeightSyncConfig(), reference=synced_state(moe_model(seed=3)), generator=generator)
    sources = {e.source for e in ws.plan.entries}
    for layer in range(2):
        for key in ("w1_EFD", "w2_EDF", "w3_EFD"):
            assert f"layers.{layer}.moe.routed_experts.inner_experts.{key}" in sources
        assert f"layers.{layer}.moe.router.gate.weight" in sources
    # The gate (w1) and up (w3) rows of each expert are halves of vLLM's stacked w13 layout.
    w13 = generator.model.all_tensors()["layers.0.moe.w13_weight"]
    assert w13.shape == (8, 2 * 64, 64)


@pytest.mark.parametrize("corrupt, message", [
    (lambda s: s.__setitem__("layers.0.moe.routed_experts.inner_experts.w2_EDF", torch.zeros(7, 64, 64)),
     "layers.0.moe.routed_experts.inner_experts.w2_EDF (7, 64, 64) != (8, 64, 64)"),
    (lambda s: s["layers.1.moe.routed_experts.inner_experts.w1_EFD"][5].view(-1)[3].fill_(float("nan")),
     "layers.1.moe.routed_experts.inner_experts.w1_EFD"),
    (lambda s: s.pop("layers.0.moe.router.gate.weight"), "missing ['layers.0.moe.router.gate.weight']"),
], ids=["shape", "nan", "missing-router"])
def test_bad_expert_state_dict_is_refused_before_any_write(generator, corrupt, message):
    good = moe_model(seed=4)
    ws = _sync(generator, synced_state(good), 4)
    before = {k: v.clone() for k, v in generator.model.all_tensors().items()}
    bad = {k: v.detach().clone() for k, v in synced_state(moe_model(seed=5)).items()}
    corrupt(bad)
    with pytest.raises(ValueError, match=re.escape(message)):
        ws.sync(bad, version=5)
    assert generator.weight_version == 4
    after = generator.model.all_tensors()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_generator_hands_over_its_expert_choices_and_replay_makes_the_trainer_use_them(generator):
    model = moe_model(seed=6)
    _sync(generator, synced_state(model), 6)
    rollouts = generator.generate(PROMPTS, n=2, seed=1)
    assert rollouts.routes is not None and len(rollouts.routes) == len(rollouts.completion_ids)
    for p, c, r in zip(rollouts.prompt_ids, rollouts.completion_ids, rollouts.routes):
        assert r.shape == (len(p) + len(c) - 1, 2, 2)
        assert (r >= 0).all() and (r < 8).all()  # every computed position, the prefix-cached prompts included

    # A trainer whose routers differ from the generator's (another seed's gates) routes elsewhere on its own...
    trainer = moe_model(seed=6)
    with torch.no_grad():
        for router in routers(trainer):
            router.gate.weight.copy_(torch.randn_like(router.gate.weight))
    used = []  # the expert ids each MoE layer's experts actually ran with
    hooks = [block.moe.routed_experts.register_forward_pre_hook(lambda m, args: used.append(args[2].clone()))
             for block in trainer.layers.values()]
    p, c, r = rollouts.prompt_ids[0], rollouts.completion_ids[0], rollouts.routes[0]
    tokens_BL = torch.tensor([p + c])
    given_BLNK = torch.full((1, len(p) + len(c), 2, 2), -1, dtype=torch.int16)
    given_BLNK[0, : r.shape[0]] = torch.from_numpy(r)
    rs = routers(trainer)
    with torch.no_grad(), routing(rs, record=True):
        trainer(tokens_BL)
        own_BLNK = recorded(rs)
    assert not torch.equal(own_BLNK[0, :-1].sort(-1).values, given_BLNK[0, :-1].long().sort(-1).values)
    # ...and with the generator's choices replayed, its experts run with exactly those ids.
    used.clear()
    with torch.no_grad(), routing(rs, replay_BLNK=given_BLNK, record=True):
        trainer(tokens_BL)
    for n, ids_BLK in enumerate(used):
        assert torch.equal(ids_BLK[0, :-1], given_BLNK[0, :-1, n].long())
    for h in hooks:
        h.remove()


@pytest.mark.slow  # its own engine: ~28 s on 2 shared cores
def test_auto_load_of_an_moe_export_serves_its_weights(tmp_path):
    """load_format=auto on a Qwen3 MoE folder: the HF experts land in the fused layout through the sync's views."""
    from torchtitan_rl.config import GeneratorConfig, ModelConfig
    from torchtitan_rl.engine.engine import Engine
    from torchtitan_rl.export import export_hf

    model, shape = moe_model(seed=8), tiny_shape("tiny-moe")
    folder = export_hf(synced_state(model), shape=shape, out_dir=tmp_path / "hf", dtype="float32")
    gen = Engine(GeneratorConfig(load_format="auto"), model_config=ModelConfig(hf_checkpoint=str(folder)),
                 shape=shape, seed=0, device="cpu", workdir=tmp_path / "work")
    try:
        assert_serves(gen.generate(PROMPTS, n=2, seed=0), model, not_=[moe_model(seed=9)])
    finally:
        gen.close()
