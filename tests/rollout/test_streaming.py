"""The own-rank layout's long-tail features end to end (torchrun, gloo on CPU): groups streamed to the trainer
(generator.stream_groups), syncs landing in a running generate (generator.inflight_updates), partial rollouts.

Where a sync lands in flight depends on timing, so these runs check the protocol and the bounds; that a sync
lands between two engine steps and its tokens carry the new version is tests/engine/test_partial_engine.py's.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, free_port, not_measured, repo_env

CPU_TINY = REPO / "run_configs" / "cpu_tiny.toml"
SHORT = {"trainer.steps": 3, "grpo.prompts_per_step": 8, "weight_sync.transport": "nccl", "batch_invariant_mode": "true"}
"""One trainer rank + one generator rank, batch-invariant: per-group and whole-batch recomputes are equal bits."""
TAIL = {"trainer.steps": 5, "weight_sync.transport": "nccl", "grpo.max_staleness": 1,
        "generator.inflight_updates": "true", "generator.stream_groups": "true",
        "grpo.partial.enable": "true", "grpo.partial.over_sample": 2, "grpo.partial.max_token_age": 3,
        "grpo.prompts_per_step": 8, "generator.max_num_seqs": 2, "generator.sampling.max_tokens": 48,
        "grpo.task_without_checkpoint": "digits:repeat_first", "grpo.harness_lengths.distribution": "lognormal",
        "grpo.harness_lengths.median": 32, "grpo.harness_lengths.p90": 44, "grpo.importance_correction": "truncate"}
"""2 trainer ranks + 1 generator rank, asynchronous, with every feature on (async scheduling too). A request's 80
samples run to drawn lengths of ~32 tokens (the timing harness: eos ignored), 2 at a time: ~5x as long for the
generator as a step of 64 rows for the trainer, so each step's sync is posted while the generator is in the middle
of the next request (at 4 at a time, ~3x, a loaded CI box once had every generate end first)."""


def _torchrun(nproc: int, output_dir: Path, overrides: dict) -> list[dict]:
    args = [a for k, v in overrides.items() for a in (f"--{k}", str(v))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), "-m", "torchtitan_rl.simple_grpo", "--config", str(CPU_TINY), "--job.output_dir",
           str(output_dir), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=repo_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(line) for line in (output_dir / "latest" / "metrics.jsonl").read_text().splitlines()]


def _same(record: dict) -> dict:
    return {k: v for k, v in not_measured(record).items() if not k.startswith("stream_")}


@pytest.mark.slow
def test_streamed_groups_change_nothing_but_when_the_trainer_recomputes_them(tmp_path):
    plain = _torchrun(2, tmp_path / "plain", SHORT)
    streamed = _torchrun(2, tmp_path / "streamed", {**SHORT, "generator.stream_groups": "true"})
    # Every group reached the trainer before the step's rollouts (the last ones with them) ...
    assert all(r["stream_groups_early"] == SHORT["grpo.prompts_per_step"] for r in streamed)
    # ... and the step is the same, bit for bit: the same samples, and pi_old of each group alone equals its
    # row of the whole batch's recompute in batch-invariant mode.
    assert [_same(r) for r in streamed] == [_same(r) for r in plain]


@pytest.mark.slow
def test_partial_rollouts_stream_and_take_syncs_in_flight_on_their_own_rank(tmp_path):
    records = _torchrun(3, tmp_path / "tail", TAIL)
    assert [r["step"] for r in records] == list(range(TAIL["trainer.steps"]))
    bound = TAIL["grpo.partial.max_token_age"]
    for r in records:
        ages = [r[f"version_age_{k}_frac"] for k in range(bound + 1)]
        assert sum(ages) == pytest.approx(1.0) and r["version_age_max"] <= bound, r
        assert r["stream_groups_early"] > 0 and r["partial_dropped_samples"] == 0, r
        assert r["staleness"] <= 1 and r["grad_norm"] > 0, r
    # Samples were cut and continued: tokens two or more versions old trained.
    assert sum(r["partial_carried_samples"] for r in records) > 0
    assert max(r["version_age_max"] for r in records) >= 2
    # Step k's request started under version k - 1, and sync k landed in it: its later tokens are version k's.
    # Whether a sync finds the request still running is the machines' timing (on a loaded CI box one step's
    # generate ended first), so one step of it is the proof, not every step.
    assert any(r["version_age_0_frac"] > 0 and r["version_age_1_frac"] > 0 for r in records[1:]), records
