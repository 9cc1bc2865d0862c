"""The GRPO loop with the generator on its own rank (weight_sync.transport = "nccl"; gloo on CPU).

torchrun runs simple_grpo exactly as a user does: 3 processes (2 FSDP trainer
ranks + the generator rank) for training and resume, 2 for batch-invariant
mode. Tiny config, few steps, 8 prompts per step: each launch is ~40 s on
2 CPU cores.
"""

import gc
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers import assert_one_line_error, run_cli
from tests.helpers import BF16_MISMATCH_MEAN, free_port
from torchtitan_rl import simple_grpo
from torchtitan_rl.config import load_toml, validate
from torchtitan_rl.generator.remote import _Mailbox, _receive

REPO = Path(__file__).resolve().parents[2]
CPU_TINY = REPO / "run_configs" / "cpu_tiny.toml"
STEPS = 3
OVERRIDES = {"trainer.steps": STEPS, "grpo.prompts_per_step": 8}
"""The nccl runs and the colocated run they are compared with."""
NCCL = {"weight_sync.transport": "nccl", "trainer.checkpoint.enable": "true", "trainer.checkpoint.interval": 2}


def _args(overrides: dict) -> list[str]:
    return [a for k, v in overrides.items() for a in (f"--{k}", str(v))]


def _torchrun(nproc: int, output_dir: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-port", str(free_port()), "-m", "torchtitan_rl.simple_grpo", "--config", str(CPU_TINY),
        "--job.output_dir", str(output_dir), *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _records(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def nccl_run(tmp_path_factory) -> tuple[Path, list[dict], list[dict]]:
    """Steps 0..2 on 2 trainer ranks + 1 generator rank (checkpoint after step 1), then step 2 again
    from that checkpoint (--resume) in a new torchrun world: (folder, first run, resumed run)."""
    folder = tmp_path_factory.mktemp("nccl_grpo")
    _torchrun(3, folder, *_args({**OVERRIDES, **NCCL}))
    first = _records(folder)
    _torchrun(3, folder, *_args({**OVERRIDES, **NCCL}), "--resume")
    return folder, first, _records(folder)[len(first):]


@pytest.mark.slow
def test_nccl_run_trains_with_the_generator_on_its_own_rank(nccl_run):
    folder, records, _ = nccl_run
    assert [r["step"] for r in records] == list(range(STEPS))
    # Step N samples with the weights after N optimizer steps, moved over the transport.
    assert [r["weight_version"] for r in records] == list(range(STEPS))
    assert all(0 <= r["reward_mean"] <= 1 and r["tokens"] > 0 for r in records), records
    assert all(r["sync_s"] > 0 and r["grad_norm"] > 0 for r in records), records
    # The generator on its own process scores the sampled tokens as the FSDP trainer does.
    assert max(r["mismatch_mean"] for r in records) < BF16_MISMATCH_MEAN, records
    assert load_toml(folder / "config.toml").weight_sync.transport == "nccl"


@pytest.mark.slow
def test_nccl_first_step_matches_the_colocated_run(nccl_run, tmp_path):
    _, records, _ = nccl_run
    cfg = load_toml(CPU_TINY)
    cfg.job.output_dir = str(tmp_path)
    cfg.trainer.steps, cfg.grpo.prompts_per_step = 1, OVERRIDES["grpo.prompts_per_step"]
    (colocated,) = simple_grpo.run(cfg)  # one process: trainer and generator together
    gc.collect()
    nccl = records[0]
    # Same initial weights, prompts and seeds: the same samples ...
    for key in ("reward_mean", "reward_max", "tokens", "weight_version", "mismatch_max"):
        assert nccl[key] == colocated[key], key
    # ... and the same loss; FSDP over 2 ranks vs 1 only reorders sums (fp32 loss terms: 1e-6; the bf16
    # gradient partial sums: 1e-3 relative, a few bf16 steps averaged over the norm).
    assert abs(nccl["loss"] - colocated["loss"]) < 1e-6, (nccl, colocated)
    assert abs(nccl["grad_norm"] - colocated["grad_norm"]) < 1e-3 * colocated["grad_norm"], (nccl, colocated)
    assert abs(nccl["mismatch_mean"] - colocated["mismatch_mean"]) < 1e-6, (nccl, colocated)


@pytest.mark.slow
def test_nccl_resume_matches_uninterrupted_run(nccl_run):
    folder, first, resumed = nccl_run
    assert (folder / "checkpoints" / "step-2").is_dir()
    assert [r["step"] for r in resumed] == [2]
    # The new generator rank's first weights come from the resumed trainer ...
    assert resumed[0]["weight_version"] == 2
    # ... and the step is the uninterrupted run's, bit for bit.
    for key in ("reward_mean", "loss", "grad_norm", "mismatch_mean", "mismatch_max", "tokens"):
        assert resumed[0][key] == first[2][key], key


@pytest.mark.slow
def test_nccl_batch_invariant_lora_run_has_zero_differing_tokens_every_step(tmp_path):
    # One trainer rank + the generator rank. LoRA adapters: after the first sync only they move.
    _torchrun(2, tmp_path, *_args(OVERRIDES), "--weight_sync.transport", "nccl", "--batch-invariant-mode",
              "--model.lora.rank", "8", "--trainer.optimizer.lr", "2e-2")
    records = _records(tmp_path)
    assert [r["weight_version"] for r in records] == list(range(STEPS))
    # Bitwise, also after adapter-only syncs (stale adapters would differ from the trainer's).
    assert [r["mismatch_frac_tokens"] for r in records] == [0.0] * STEPS
    assert all(r["mismatch_max"] == 0.0 and r["grad_norm"] > 0 for r in records), records


# -------------------------------------------------------------- user errors


def test_nccl_without_torchrun_is_a_one_line_config_error():
    proc = run_cli("--config", str(CPU_TINY), "--weight_sync.transport", "nccl")
    assert_one_line_error(proc, "weight_sync.transport", "torchrun", "got world size 1")


def test_nccl_on_one_torchrun_rank_is_a_config_error(tmp_path):
    proc = _torchrun(1, tmp_path, "--weight_sync.transport", "nccl", check=False)
    assert proc.returncode != 0
    assert "config error: weight_sync.transport: 'nccl' puts the generator on its own rank" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_run_refuses_nccl_outside_torchrun(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_toml(CPU_TINY)
    cfg.job.output_dir, cfg.weight_sync.transport = str(tmp_path), "nccl"
    with pytest.raises(ValueError, match="weight_sync.transport: 'nccl'.*torchrun"):
        simple_grpo.run(cfg)


def test_nccl_layout_validation():
    cfg = load_toml(CPU_TINY)
    cfg.weight_sync.transport = "nccl"
    cfg.trainer.parallelism.data_parallel_shard_degree = 2
    validate(cfg, world_size=3)  # 2 trainer ranks + the generator rank
    with pytest.raises(ValueError, match=r"trainer.parallelism: .* != world size 3"):
        validate(cfg, world_size=4)
    cfg.trainer.parallelism.data_parallel_shard_degree = -1
    cfg.model.lora.rank, cfg.model.lora.sync = 8, "merged"
    with pytest.raises(ValueError, match="model.lora.sync: 'merged' is not supported with weight_sync.transport"):
        validate(cfg, world_size=2)
    cfg.model.lora.sync = "adapter"
    cfg.generator.parallelism.tensor_parallel_degree = 2
    with pytest.raises(ValueError, match="generator.parallelism.tensor_parallel_degree: .* must be 1"):
        validate(cfg, world_size=3)


# ---------------------------------------------- a peer that died: no endless wait


class _NoSync:
    """A receiver whose trainer never sends the announced sync."""

    def receive(self, timeout_s):
        return None


def test_waits_for_a_dead_peer_end_with_a_clear_error():
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timedelta(seconds=30))
    mailbox = _Mailbox(store, timeout_s=0.5, peer="trainer")
    with pytest.raises(RuntimeError, match=r"no request from the trainer within weight_sync.peer_timeout_s"):
        mailbox.get("msg", "request")
    with pytest.raises(RuntimeError, match="announced a sync but sent nothing"):
        _receive(_NoSync(), mailbox, timeout_s=0.5)
    # A trainer that rejected its state dict sends "stop" instead: the generator stops waiting at once.
    trainer = _Mailbox(store, timeout_s=0.5, peer="generator rank")
    trainer.put("msg", {"op": "stop"})
    _receive(_NoSync(), mailbox, timeout_s=30.0)
    assert mailbox.get("msg", "request") == {"op": "stop"}
    assert not store.check(["torchtitan_rl/generator/msg/0"])  # read messages are deleted


def test_nccl_heldout_evaluation_runs_on_the_generator_rank(tmp_path, smollm2_dir):
    # The greedy SamplingConfig travels in the generate message to the generator rank.
    chat = {"grpo.task": "math", "task.tokenizer": smollm2_dir, "task.heldout_size": 4, "grpo.prompts_per_step": 2,
            "grpo.group_size": 2, "model.max_seq_len": 128, "generator.max_model_len": 128,
            "generator.sampling.max_tokens": 4, "trainer.steps": 2, "eval.every_n_steps": 1}
    _torchrun(2, tmp_path, *_args(chat), "--weight_sync.transport", "nccl")
    evals = [r for r in _records(tmp_path) if "eval_accuracy" in r]
    assert [(r["step"], r["eval_weight_version"], r["eval_prompts"]) for r in evals] == [(0, 0, 4), (1, 1, 4), (2, 2, 4)]
    assert all(r["eval_completion_tokens"] <= 4 for r in evals)
