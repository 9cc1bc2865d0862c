"""The colocated layout on every trainer rank (generator.colocated_ranks = "all", the default under torchrun).

torchrun runs simple_grpo as a user does: 2 gloo ranks on CPU, each an FSDP
trainer shard and a vLLM engine of its own, each generating half of every
batch. One 40-step run (a checkpoint after step 38) and its resume serve
the tests; a launch is ~15 s on 2 CPU cores plus ~1 s a step. Two 3-step runs check generator.overlap_training.
"""

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, free_port, not_measured, repo_env
from torchtitan_rl import simple_grpo
from torchtitan_rl.config import load_toml

CPU_TINY = REPO / "run_configs" / "cpu_tiny.toml"
STEPS = 40
"""As tests/test_simple_grpo.py's learning run (40 steps of 32 prompts)."""
CHECKPOINT = ["--trainer.checkpoint.enable", "true", "--trainer.checkpoint.interval", "38"]
"""One checkpoint, after step 37: the resumed run redoes steps 38 and 39."""


def _torchrun(output_dir: Path, *extra: str) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        "-m", "torchtitan_rl.simple_grpo", "--config", str(CPU_TINY), "--job.output_dir", str(output_dir), *extra,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=repo_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def _records(output_dir: Path) -> list[dict]:
    """The newest run's metrics (run/folder.py: each run in its own folder, `latest` pointing at it)."""
    return [json.loads(line) for line in (output_dir / "latest" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> tuple[Path, list[dict], list[dict]]:
    """(folder, the 40-step run, its resume from the step-38 checkpoint)."""
    folder = tmp_path_factory.mktemp("colocated_all")
    _torchrun(folder, "--trainer.steps", str(STEPS), *CHECKPOINT)
    first = _records(folder)
    _torchrun(folder, "--trainer.steps", str(STEPS), *CHECKPOINT, "--resume")
    return folder, first, _records(folder)[-2:]


@pytest.mark.slow
def test_every_rank_generates_and_the_run_learns(two_rank_run):
    folder, records, _ = two_rank_run
    assert [r["step"] for r in records] == list(range(STEPS))
    assert [r["weight_version"] for r in records] == list(range(STEPS))
    # Each rank's engine wrote its own config.json: rank 0 in the run folder, rank 1 in rank1/.
    assert (folder / "latest" / "generator_model" / "config.json").is_file()
    assert (folder / "latest" / "rank1" / "generator_model" / "config.json").is_file()
    first = sum(r["reward_mean"] for r in records[:5]) / 5
    last = sum(r["reward_mean"] for r in records[-5:]) / 5
    assert first < 0.15, first  # the bounds of tests/test_simple_grpo.py's one-process run
    assert last > 0.3 and last > first + 0.2, (first, last)


@pytest.mark.slow
def test_every_rank_samples_what_one_process_does(two_rank_run, tmp_path):
    _, records, _ = two_rank_run
    cfg = load_toml(CPU_TINY)
    cfg.job.output_dir = str(tmp_path)
    cfg.trainer.steps = 1
    one = simple_grpo.train(cfg)
    gc.collect()
    # Rank r sampled prompts [r * P/2, (r + 1) * P/2) of the batch, each seeded by its global index: the same
    # samples as one engine generating all of them (a row of vLLM's CPU forward does not depend on its batch).
    two = records[0]
    for key in ("reward_mean", "reward_max", "tokens", "mismatch_max"):
        assert two[key] == one[0][key], key
    # FSDP over 2 ranks vs 1 only reorders sums: fp32 loss terms to 1e-6, bf16 gradient partial sums to 1e-3.
    assert abs(two["loss"] - one[0]["loss"]) < 1e-6, (two, one[0])
    assert abs(two["grad_norm"] - one[0]["grad_norm"]) < 1e-3 * one[0]["grad_norm"], (two, one[0])


@pytest.mark.slow
def test_every_rank_resume_matches_uninterrupted_run(two_rank_run):
    folder, first, resumed = two_rank_run
    assert [r["step"] for r in resumed] == [38, 39]
    # New engines on both ranks take the resumed trainer's weights: the same samples, bit for bit.
    for key in ("reward_mean", "loss", "grad_norm", "mismatch_mean", "mismatch_max", "tokens", "weight_version"):
        assert [r[key] for r in resumed] == [r[key] for r in first[38:]], key


@pytest.mark.slow
def test_every_rank_batch_invariant_lora_run_has_zero_differing_tokens_every_step(tmp_path):
    # Each rank's engine gets the base once, then adapters only; a stale adapter on either would differ.
    _torchrun(tmp_path, "--trainer.steps", "3", "--grpo.prompts_per_step", "8", "--batch-invariant-mode",
              "--model.lora.rank", "8", "--trainer.optimizer.lr", "2e-2")
    records = _records(tmp_path)
    assert [r["weight_version"] for r in records] == [0, 1, 2]
    assert [r["mismatch_frac_tokens"] for r in records] == [0.0] * 3
    assert all(r["mismatch_max"] == 0.0 and r["grad_norm"] > 0 for r in records), records


@pytest.mark.slow
def test_every_rank_cuts_its_block_of_a_partial_request_and_resumes_bit_for_bit(tmp_path):
    # Each rank's engine generates its block of the pool (carried groups + new ones) and stops once its share of
    # the step's groups is finished; the cut samples go back into the shared buffer, which the checkpoint holds.
    # Lengths drawn by the timing harness (eos ignored, up to 16 tokens), so that groups finish apart.
    partial = ["--trainer.steps", "4", "--grpo.partial.enable", "true", "--grpo.partial.over_sample", "8",
               "--grpo.importance_correction", "truncate", "--trainer.checkpoint.enable", "true",
               "--trainer.checkpoint.interval", "3", "--grpo.task_without_checkpoint", "digits:repeat_first",
               "--grpo.harness_lengths.distribution", "lognormal", "--grpo.harness_lengths.median", "3",
               "--grpo.harness_lengths.p90", "10", "--generator.sampling.max_tokens", "16"]
    _torchrun(tmp_path, *partial)
    first = _records(tmp_path)
    assert all(r["partial_carried_samples"] > 0 for r in first) and all(r["version_age_1_frac"] > 0 for r in first[1:])
    # the trainer's ranks get equal rows and tokens within a row's (grpo/batch.py's rank_rows), whatever the order
    assert all(0.99 < r["train_rank_balance"] <= 1.0 for r in first), [r["train_rank_balance"] for r in first]
    _torchrun(tmp_path, *partial, "--resume")
    resumed = _records(tmp_path)[3:]
    assert [r["step"] for r in resumed] == [3]
    assert not_measured(resumed[0]) == not_measured(first[3])


@pytest.mark.slow
def test_every_rank_generates_beside_training_and_trains_the_same_run(tmp_path):
    # generator.overlap_training on 2 ranks: each rank's engine generates its block of request k + 1 in its own
    # thread while step k trains; the all-gather of the blocks runs on the loop's thread. The same run, bit for bit.
    ahead = ["--trainer.steps", "3", "--grpo.max_staleness", "1", "--grpo.importance_correction", "truncate"]
    _torchrun(tmp_path / "in_turn", *ahead)
    _torchrun(tmp_path / "beside", *ahead, "--generator.overlap_training", "true")
    in_turn, beside = _records(tmp_path / "in_turn"), _records(tmp_path / "beside")
    assert [r["weight_version"] for r in beside] == [0, 0, 1]
    assert [not_measured(r) for r in beside] == [not_measured(r) for r in in_turn]
