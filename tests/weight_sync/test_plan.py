"""The coverage proof: built from real tensors, it fails loudly and names names."""

import pytest
import torch

from tests.helpers import checkpoint_state, native_state, tiny_shape, trainer_model
from torchtitan_rl.engine.vllm_model import all_tensors, sync_targets
from torchtitan_rl.weight_sync.plan import Destination, build_plan


def _destinations(model):
    """Plain-torch stand-in for the generator side: a second tiny model's tensors."""
    tensors = native_state(model)
    dests = {k: Destination(t.detach(), t.shape) for k, t in tensors.items()}
    return dests, {k: t.detach() for k, t in tensors.items()}


def test_plan_covers_every_generator_tensor():
    src, dst = trainer_model(seed=0), trainer_model(seed=1)
    dests, gen_tensors = _destinations(dst)
    plan = build_plan(sources=native_state(src), destinations=dests, generator_tensors=gen_tensors, constants={})
    assert {e.source for e in plan.entries} == set(native_state(src))
    assert plan.nbytes == sum(t.numel() * t.element_size() for t in gen_tensors.values())


def test_uncovered_generator_buffer_fails_with_its_name():
    src, dst = trainer_model(seed=0), trainer_model(seed=1)
    dests, gen_tensors = _destinations(dst)
    sources = native_state(src)
    sources.pop("layers.1.attention.rope.cache")
    dests.pop("layers.1.attention.rope.cache")
    with pytest.raises(ValueError, match=r"unwritten: \['layers.1.attention.rope.cache'\]"):
        build_plan(sources=sources, destinations=dests, generator_tensors=gen_tensors, constants={})


def test_trainer_tensor_without_destination_fails_with_its_name():
    src, dst = trainer_model(seed=0), trainer_model(seed=1)
    dests, gen_tensors = _destinations(dst)
    sources = native_state(src)
    sources["layers.0.attention.extra_bias"] = torch.zeros(4)
    with pytest.raises(ValueError, match="no generator destination.*extra_bias"):
        build_plan(sources=sources, destinations=dests, generator_tensors=gen_tensors, constants={})


def test_fused_and_split_names_together_are_written_twice():
    """Native wqkv and checkpoint-format wq/wk/wv both present: overlap is caught."""
    src, gen = trainer_model(seed=0), trainer_model(seed=1)
    sources = {**native_state(src), **checkpoint_state(src)}
    with pytest.raises(ValueError, match="written twice"):
        build_plan(
            sources=sources,
            destinations=sync_targets(gen, tiny_shape()),
            generator_tensors=all_tensors(gen),
            constants={},
        )


def test_checkpoint_format_split_views_tile_the_fused_qkv_exactly():
    src, gen = trainer_model(seed=0), trainer_model(seed=1)
    sources = checkpoint_state(src)
    plan = build_plan(
        sources=sources, destinations=sync_targets(gen, tiny_shape()), generator_tensors=all_tensors(gen), constants={}
    )
    with torch.no_grad():
        for e in plan.entries:
            e.dest.copy_(sources[e.source].view(e.dest.shape))
    for name, p in src.named_parameters():
        assert torch.equal(dict(gen.named_parameters())[name], p), name


def test_untied_trainer_into_tied_generator_is_refused():
    src, dst = trainer_model(seed=0), trainer_model(seed=1)
    dests, gen_tensors = _destinations(dst)
    dests["lm_head.weight"] = dests["tok_embeddings.weight"]
    sources = native_state(src)
    sources["lm_head.weight"] = sources["tok_embeddings.weight"].detach().clone()
    with pytest.raises(ValueError, match="tie different tensors"):
        build_plan(sources=sources, destinations=dests, generator_tensors=gen_tensors, constants={})


def test_tensors_sharing_one_flat_buffer_are_each_checked():
    """LoRA adapters in the generator are views of one buffer: a missing one still shows."""
    from torchtitan_rl.config import LoRAConfig
    from torchtitan_rl.models.lora import apply_lora

    lora = LoRAConfig(rank=2)
    src, gen = trainer_model(seed=0), trainer_model(seed=1)
    apply_lora(src, lora)
    apply_lora(gen, lora, flat=True, train=False)
    sources = native_state(src)
    dests = sync_targets(gen, tiny_shape())
    plan = build_plan(sources=sources, destinations=dests, generator_tensors=all_tensors(gen), constants={})
    assert any(e.source.endswith("lora_b") for e in plan.entries)
    missing = "layers.1.feed_forward.w3.lora_b"
    sources.pop(missing)
    dests.pop(missing)
    with pytest.raises(ValueError, match=rf"unwritten: \['{missing}'\]"):
        build_plan(sources=sources, destinations=dests, generator_tensors=all_tensors(gen), constants={})
