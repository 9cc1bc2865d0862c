"""Two model families, Qwen3 and Llama: chosen from config.json, computed as transformers computes them."""

import json
import shutil

import pytest
import torch

from tests.helpers import BF16_MISMATCH_MEAN, free_port, repo_env, run_cli
from torchtitan_rl.config import LoRAConfig
from torchtitan_rl.config.job_config import ModelConfig, TrainerConfig
from torchtitan_rl.models.families import resolve_shape
from torchtitan_rl.models.lora import apply_lora
from torchtitan_rl.models.shape import build_titan_model
from torchtitan_rl.engine.vllm_model import all_tensors, sync_targets
from torchtitan_rl.weight_sync.plan import build_plan

FAMILIES = ["qwen3", "llama"]

# Random-weight tokens: 2 sequences of 12 from the tiny checkpoints' 32-token vocabulary.
TOKENS_BL = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(0))

# fp32 on both sides, and the same op sequence (SDPA, RMSNorm, rotate-half
# RoPE): measured max difference 0.0 on this CPU. Another CPU or kernel may
# sum in another order (~1e-7 relative per op); 1e-4 allows that and is far
# below what a wrong layout, eps or RoPE convention gives (> 1e-1).
FP32_ATOL = 1e-4


def shape_of(folder):
    return resolve_shape(flavor="tiny", hf_checkpoint=str(folder), vocab_size=0, max_seq_len=64)


def hf_logprobs(folder, tokens_BL, dtype=torch.float32) -> torch.Tensor:
    """transformers' own forward of the folder: [B, L] logprobs, column 0 zero (the trainer's layout)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    with torch.no_grad():
        logits = model(tokens_BL).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens_BL[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(lp, (1, 0))


def make_trainer(folder, tmp_path, *, dtype="float32", **model_fields):
    from torchtitan_rl.trainer import Trainer

    return Trainer(
        TrainerConfig(), model_config=ModelConfig(hf_checkpoint=str(folder), dtype=dtype, **model_fields),
        shape=shape_of(folder), seed=0, device=torch.device("cpu"), output_dir=tmp_path,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_logprobs_equal_transformers_forward_of_the_same_folder(family, tiny_hf_checkpoint, tmp_path):
    folder = tiny_hf_checkpoint(family)
    trainer = make_trainer(folder, tmp_path)
    got = trainer.token_logprobs(TOKENS_BL, temperature=1.0)
    want = hf_logprobs(folder, TOKENS_BL)
    assert want[:, 1:].std() > 0.5  # logprobs spread: the comparison can see a wrong model
    torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_comes_from_config_json(family, tiny_hf_checkpoint):
    shape = shape_of(tiny_hf_checkpoint(family))
    assert shape.family.name == family
    assert shape.qk_norm == (family == "qwen3")
    names = {n for n, _ in build_titan_model(shape, seed=0).named_parameters()}
    assert any(n.endswith("attention.q_norm.weight") for n in names) == shape.qk_norm


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("lora", [None, LoRAConfig(rank=2)], ids=["full", "lora"])
def test_both_families_pass_the_coverage_proof(family, lora, tiny_hf_checkpoint):
    shape = shape_of(tiny_hf_checkpoint(family))
    src, gen = build_titan_model(shape, seed=0), build_titan_model(shape, seed=1)
    if lora is not None:
        apply_lora(src, lora)
        apply_lora(gen, lora, flat=True, train=False)
    sources = {**dict(src.named_parameters()), **dict(src.named_buffers())}
    plan = build_plan(sources=sources, destinations=sync_targets(gen, shape), generator_tensors=all_tensors(gen),
                      constants={})
    assert {e.source for e in plan.entries} == set(sources)


def _with_config(tiny_hf_checkpoint, tmp_path, **changes):
    """A copy of the tiny Llama checkpoint under tmp_path/ckpt with config.json fields changed."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_hf_checkpoint("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


def test_unsupported_architecture_is_one_clear_error(tiny_hf_checkpoint, tmp_path):
    folder = _with_config(tiny_hf_checkpoint, tmp_path, architectures=["MistralForCausalLM"])
    with pytest.raises(ValueError) as e:
        shape_of(folder)
    message = str(e.value)
    for text in ("model.hf_checkpoint", str(folder / "config.json"), "MistralForCausalLM", "LlamaForCausalLM"):
        assert text in message, message

    proc = run_cli("--model.hf_checkpoint", str(folder), "--job.output_dir", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"torchtitan_rl: error: {message}"], proc.stderr


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
"""Llama 3.1's RoPE scaling, its original context shrunk to 16 so that positions < 64 see every band."""


def test_llama3_rope_scaling_computes_as_transformers(tiny_hf_checkpoint, tmp_path):
    folder = _with_config(tiny_hf_checkpoint, tmp_path, rope_parameters=LLAMA3_ROPE)
    assert shape_of(folder).rope_scaling["factor"] == 8.0
    trainer = make_trainer(folder, tmp_path)
    got = trainer.token_logprobs(TOKENS_BL, temperature=1.0)
    torch.testing.assert_close(got, hf_logprobs(folder, TOKENS_BL), atol=FP32_ATOL, rtol=0)
    # The scaling matters at these positions: the unscaled model is far off.
    plain = _with_config(tiny_hf_checkpoint, tmp_path / "plain", rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert (got - hf_logprobs(plain, TOKENS_BL)).abs().max() > 1e-2


def test_other_rope_scaling_is_refused_not_ignored(tiny_hf_checkpoint, tmp_path):
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32}
    folder = _with_config(tiny_hf_checkpoint, tmp_path, rope_parameters=yarn)
    with pytest.raises(ValueError, match=r"config.json: not supported by this decoder: RoPE scaling 'yarn'"):
        shape_of(folder)


@pytest.mark.slow
def test_llama_flavor_trains_and_exports_under_fsdp_on_two_ranks(tmp_path):
    """parallelize_qwen3 (FSDP2 over 2 gloo ranks) on a Llama shape: two CLI steps, then the sharded export."""
    import subprocess
    import sys

    from tests.helpers import REPO

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "torchtitan_rl.simple_grpo", "--config", "run_configs/cpu_tiny.toml", "--model.flavor", "tiny-llama",
           "--trainer.steps", "2", "--job.output_dir", str(tmp_path / "out"), "--job.export_dir", str(tmp_path / "hf")]
    env = repo_env()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "latest" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["mismatch_mean"] < BF16_MISMATCH_MEAN for r in records), records
    from transformers import AutoModelForCausalLM  # every rank joined the gathers, rank 0 wrote

    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "hf")).__name__ == "LlamaForCausalLM"
