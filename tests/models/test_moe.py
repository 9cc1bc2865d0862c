"""Qwen3 MoE in models/: torchtitan's MoE blocks, HF names both ways, and the export transformers loads."""

import dataclasses
import json
import re

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import REPO, assert_one_line_error, run_cli, tiny_shape
from torchtitan_rl.config import JobConfig, LoRAConfig, ParallelismConfig, PartialRolloutConfig, load_toml
from torchtitan_rl.export import export_hf
from torchtitan_rl.models.families import from_hf, shape_from_hf_config
from torchtitan_rl.models.lora import apply_lora, is_lora_key
from torchtitan_rl.models.moe import synced, synced_state
from torchtitan_rl.models.shape import build_titan_model
from torchtitan_rl.run.parts import run_shape, run_task

CPU_TINY = REPO / "run_configs" / "cpu_tiny.toml"


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
    state = synced_state(model)
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
    shape = dataclasses.replace(tiny_shape("tiny-moe"), load_balance_coeff=1e-3)
    model = build_titan_model(shape, seed=1)
    with pytest.raises(ValueError, match="routing bias"):
        export_hf(dict(model.named_parameters()), shape=shape, out_dir=tmp_path / "hf")


def test_lora_on_moe_adapts_attention_only_and_freezes_experts_and_routers():
    model = build_titan_model(tiny_shape("tiny-moe"), seed=0)
    apply_lora(model, LoRAConfig(rank=4))
    adapted = sorted({name.rsplit(".", 2)[-2] for name, _ in model.named_parameters() if is_lora_key(name)})
    assert adapted == ["wo", "wqkv"]
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trained and all(is_lora_key(name) for name in trained)


def _cpu_tiny_moe(**fields) -> JobConfig:
    cfg = load_toml(CPU_TINY)
    cfg.model.flavor = "tiny-moe"
    for path, value in fields.items():
        section, name = path.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


@pytest.mark.parametrize("fields, message", [
    ({"model__flavor": "tiny", "grpo__routing_replay": True}, "grpo.routing_replay: Qwen3ForCausalLM has no experts"),
    ({"model__flavor": "tiny", "model__moe_load_balance_coeff": 1e-3},
     "model.moe_load_balance_coeff: 0.001 needs an MoE"),
    ({"grpo__routing_replay": True, "weight_sync__transport": "nccl"},
     "grpo.routing_replay: needs the generator's expert choices"),
    ({"model__moe_load_balance_coeff": 1e-3, "job__export": True}, "model.moe_load_balance_coeff: > 0 gives"),
    ({"model__lora": LoRAConfig(rank=4, target_modules=("w1", "w2", "w3"))}, "model.lora.target_modules: ['w1'"),
    ({"grpo__partial": PartialRolloutConfig(enable=True)}, "grpo.partial.enable: a cut sample's expert choices"),
    ({"generator__stream_groups": True}, "generator.stream_groups: a streamed group is recomputed before"),
    ({"model__flavor": "tiny", "trainer__parallelism": ParallelismConfig(expert_parallel_degree=2)},
     "trainer.parallelism.expert_parallel_degree: Qwen3ForCausalLM has no experts to place"),
    ({"trainer__parallelism": ParallelismConfig(expert_parallel_degree=3)},
     "trainer.parallelism.expert_parallel_degree: 3 does not divide the model's 8 experts"),
    ({"grpo__old_logprobs": "train"}, "grpo.old_logprobs: 'train' skips the recompute, which records"),
], ids=["replay-dense", "balance-dense", "replay-nccl", "balance-export", "lora-mlp-only", "partial", "stream",
        "ep-dense", "ep-experts", "pi-old-from-training"])
def test_what_moe_cannot_do_is_refused_naming_the_field(fields, message):
    cfg = _cpu_tiny_moe(**fields)
    with pytest.raises(ValueError, match=re.escape(message)):
        run_shape(cfg, run_task(cfg))


def test_batch_invariant_moe_is_one_line_naming_why(tmp_path):
    proc = run_cli("--config", str(CPU_TINY), "--model.flavor", "tiny-moe", "--batch-invariant-mode",
                   "--job.output_dir", str(tmp_path))
    assert_one_line_error(proc, "batch_invariant_mode: not for MoE models", prefix="torchtitan_rl: error: ")
