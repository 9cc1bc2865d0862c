"""The NCCL transport (gloo on CPU): 2 FSDP trainer ranks + 1 generator rank under torchrun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import BF16_MISMATCH_MEAN, free_port

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # torchrun worlds of 2-3 processes, each with its own engine


@pytest.fixture(scope="module", params=["tiny", "tiny-llama"])
def run(request, tmp_path_factory) -> tuple[dict, dict]:
    """What nccl_worker.py saw: (trainer rank 0's record, the generator's record), for a Qwen3 and a Llama."""
    folder = tmp_path_factory.mktemp("nccl")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(free_port()),
        str(Path(__file__).with_name("nccl_worker.py")), str(folder), request.param,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((folder / "result.json").read_text()), json.loads((folder / "generator.json").read_text())


def test_trainer_fsdp_world_excludes_the_generator_rank(run):
    trainer, gen = run
    assert trainer["trainer_world"] == 2 and trainer["dp_size"] == 2
    assert gen["default_world"] == 1  # the generator's own group, which vLLM reuses


def test_logprobs_match_trainer_after_two_syncs_with_different_weights(run):
    trainer, gen = run
    assert trainer["buckets"] > 2  # both send/receive buffers were reused
    assert gen["sync1"]["version"] == 1 and gen["sync2"]["version"] == 2
    assert trainer["v1_gen_vs_trainer"] < BF16_MISMATCH_MEAN, trainer
    assert trainer["v2_gen_vs_trainer"] < BF16_MISMATCH_MEAN, trainer
    # The version-2 rollouts are far from the version-1 weights: a stale or partial sync cannot pass.
    assert trainer["v2_rollouts_vs_v1_trainer"] > 4 * BF16_MISMATCH_MEAN, trainer


def test_every_tensor_checksummed_and_constants_checked_with_verify_full(run):
    trainer, gen = run
    assert trainer["sync1"]["verified"] == gen["plan_entries"]
    assert gen["sync1"]["verified"] == gen["plan_entries"] + gen["constants"]
    # Sync 2 skips the unchanged RoPE buffers: fewer bytes, on both sides alike.
    assert gen["sync2"]["bytes"] == trainer["sync2"]["bytes"] < trainer["sync1"]["bytes"]


def test_nan_in_one_shard_is_rejected_before_anything_is_written(run):
    trainer, gen = run
    assert "non-finite" in trainer["nan_rejected"] and "layers.1.feed_forward.w2.weight" in trainer["nan_rejected"]
    assert trainer["buckets"] > 2  # buckets were in flight when the verdict came
    assert trainer["syncs_after_reject"] == 2  # the rejected one was published and answered
    after = gen["after_reject"]
    assert after["rejected"] and after["written"] == 0
    assert after["version"] == 1 and after["syncs"] == 2
    # Still the version-1 weights, untouched: same completions, still the trainer's logprobs.
    assert after["same_completions"]
    assert trainer["after_reject_gen_vs_trainer"] < BF16_MISMATCH_MEAN


def test_generate_racing_a_sync_waits_for_it(run):
    _, gen = run
    race = gen["race"]
    assert race["waited_s"] > 0.5  # the trainer held the data back for 1 s after the header
    assert race["rollout_version"] == 2 and race["version_after"] == 2
