"""The sync from an FSDP-sharded trainer (2 ranks, torchrun, gloo) into a generator on rank 0."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import BF16_MISMATCH_MEAN, REPO, LogprobCheck, assert_within_noise, free_port, repo_env


pytestmark = pytest.mark.slow  # torchrun worlds of 2-3 processes, each with its own engine


def _torchrun(*args: str, cwd: Path = REPO, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), *args,
    ]
    env = repo_env()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def two_rank_sync(tmp_path_factory) -> dict:
    """What dist_sync_worker.py saw on two FSDP ranks (rank 0 with the generator)."""
    folder = tmp_path_factory.mktemp("dist_sync")
    _torchrun(str(Path(__file__).with_name("dist_sync_worker.py")), str(folder))
    return json.loads((folder / "result.json").read_text())


def test_trainer_state_is_really_sharded_over_two_ranks(two_rank_sync):
    layouts = two_rank_sync["layouts"]
    assert layouts[0].keys() == layouts[1].keys()
    for rank_layout in layouts:
        big = {k: v for k, v in rank_layout.items() if v["global"][0] >= 16}
        assert len(big) >= 10  # embeddings, attention and MLP weights
        for name, t in rank_layout.items():
            assert t["placements"] == "(Shard(dim=0),)", name
            assert t["local"] == [t["global"][0] // 2, *t["global"][1:]], name
    # Buffers stay plain tensors (every rank holds them whole).
    assert all("rope" in k for k in two_rank_sync["unsharded"])


def test_shards_travel_in_the_generators_dtype_and_land_as_the_same_bits(two_rank_sync):
    """Both ranks gather in rank 0's plan dtypes (bf16, not the fp32 masters), and the generator holds exactly
    the whole fp32 tensors cast to bf16: casting before the gather changes no bit."""
    assert two_rank_sync["wire"] == [["torch.bfloat16"], ["torch.bfloat16"]]
    assert two_rank_sync["same_bits"] is True


def test_fsdp_sharded_sync_matches_generator(two_rank_sync):
    v1, v2 = two_rank_sync["versions"]
    for v, version in ((v1, 1), (v2, 2)):
        assert v["rollout_version"] == version
        assert v["bytes_written"] > 0 and v["tensors_verified"] > 0
        assert v["scored_tokens"] == 3 * 2 * 8  # PROMPTS x n x max_tokens
        # The generator computes with what both ranks' shards make up ...
        assert v["gen_vs_sharded_trainer"] < BF16_MISMATCH_MEAN, v
        misses = [v["gen_vs_previous_weights"]] if v["gen_vs_previous_weights"] is not None else []
        # ... and after a step on both ranks, with the new weights, not the old.
        assert_within_noise(LogprobCheck(**v["gen_vs_single_process"]), misses=misses)
    assert two_rank_sync["train_metrics"]["grad_norm"] > 0


def test_batched_gather_equals_full_tensor_bit_for_bit(two_rank_sync):
    batched = two_rank_sync["full_many"]
    assert batched["tensors"] > 20 and batched["equal"], batched


def test_grpo_loop_runs_on_two_ranks_under_torchrun(tmp_path):
    _torchrun(
        "-m", "torchtitan_rl.simple_grpo", "--config", "run_configs/cpu_tiny.toml",
        "--trainer.steps", "2", "--job.output_dir", str(tmp_path),
    )
    records = [json.loads(line) for line in (tmp_path / "latest" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert [r["weight_version"] for r in records] == [0, 1]
    assert all(r["mismatch_mean"] < BF16_MISMATCH_MEAN for r in records), records
    assert all(r["tokens"] > 0 for r in records)  # every rank's rows, summed
