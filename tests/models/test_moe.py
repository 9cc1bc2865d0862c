"""Qwen3 MoE in models/: torchtitan's MoE blocks, HF names both ways, and the export transformers loads."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import tiny_shape
from torchtitan_rl.export import export_hf
from torchtitan_rl.models.families import from_hf, shape_from_hf_config
from torchtitan_rl.models.moe import synced
from torchtitan_rl.models.shape import build_titan_model


def test_tiny_moe_is_torchtitans_qwen3_moe_with_stacked_experts():
    model = build_titan_model(tiny_shape("tiny-moe"), seed=0)
    params = dict(model.named_parameters())
    assert params["layers.0.moe.routed_experts.inner_experts.w1_EFD"].shape == (8, 64, 64)
    assert params["layers.0.moe.routed_experts.inner_experts.w2_EDF"].shape == (8, 64, 64)
    assert params["layers.0.moe.router.gate.weight"].shape == (8, 64)
    assert not any("feed_forward" in k for k in params)
    assert not synced("layers.0.moe.tokens_per_expert_E")  # bookkeeping, not part of the served model


def test_export_loads_in_transformers_as_qwen3_moe(tmp_path):
    from transformers import AutoModelForCausalLM

    shape = tiny_shape("tiny-moe")
    model = build_titan_model(shape, seed=1)
    state = {k: v for k, v in [*model.named_parameters(), *model.named_buffers()] if synced(k)}
    out = export_hf(state, shape=shape, out_dir=tmp_path / "hf", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 8
    assert shape_from_hf_config(config, where="test") == shape  # the shape reads back

    hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    # Every tensor lands back where it came from (experts split per expert, then stacked again).
    back = from_hf(load_file(out / "model.safetensors"), shape)
    for name, t in model.state_dict().items():
        if "qkv_linear" not in name and "rope" not in name and name != "lm_head.weight":  # tied
            assert torch.equal(back[name], t.detach()), name
    tokens = torch.tensor([[1, 4, 5, 6, 14, 3, 9, 2]])
    with torch.no_grad():
        want = torch.log_softmax(model(tokens).float(), -1)
        got = torch.log_softmax(hf(tokens).logits.float(), -1)
    # torchtitan's grouped experts compute in bf16 (GroupedExperts casts): bf16 rounding, not a layout error.
    assert (got - want).abs().max() < 2e-2, (got - want).abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_export_refuses_a_routing_bias_hf_cannot_hold(tmp_path):
    import dataclasses

    shape = dataclasses.replace(tiny_shape("tiny-moe"), load_balance_coeff=1e-3)
    model = build_titan_model(shape, seed=1)
    with pytest.raises(ValueError, match="routing bias"):
        export_hf(dict(model.named_parameters()), shape=shape, out_dir=tmp_path / "hf")
