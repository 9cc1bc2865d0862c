"""The memory estimate printed at start, against what a real trainer holds (CPU: RSS)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, assert_one_line_error, run_cli
from torchtitan_rl.config import JobConfig
from torchtitan_rl.config.job_config import GeneratorConfig, ModelConfig, TrainerConfig
from torchtitan_rl.run.memory import GIB, check_fits, count_parameters, estimate, one_line_oom
from torchtitan_rl.models.families import resolve_shape

WORKER = Path(__file__).with_name("memory_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("master_dtype", ["float32", "bfloat16"])
def test_trainer_estimate_matches_measured_rss(master_dtype):
    """RSS growth from before the Trainer to after its first step (weights, gradients, AdamW state and what a step
    leaves: the tokens, the allocator's slack) is at least the estimate and at most 15% + 256 MiB above it."""
    # glibc's mmap threshold fixed at its 128 KiB default: left dynamic, it rises once big tensors are freed and
    # later freed ones stay resident, so the RSS varied from run to run (docs/design.md, "incidents").
    proc = subprocess.run([sys.executable, str(WORKER), "smollm2-135m", master_dtype], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(REPO), "PATH": "", "MALLOC_MMAP_THRESHOLD_": str(128 << 10)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["estimate"] <= got["measured"] <= 1.15 * got["estimate"] + (256 << 20), got


def test_qwen3_sizes_are_counted_exactly():
    shape = resolve_shape(flavor="8B", hf_checkpoint=None, vocab_size=0, max_seq_len=512)
    assert count_parameters(shape)[:2] == (8_190_735_360, 8_190_735_360)  # Qwen3-8B's published count


def test_an_8b_colocated_run_on_one_80gb_gpu_is_refused_naming_the_fields():
    shape = resolve_shape(flavor="8B", hf_checkpoint=None, vocab_size=0, max_seq_len=512)
    cfg = JobConfig(model=ModelConfig(flavor="8B"), generator=GeneratorConfig(gpu_memory_utilization=0.3))
    est = estimate(cfg, shape, world_size=1, device_total=80 * GIB, role="colocated")
    assert est.trainer_resident == 16 * 8_190_735_360  # fp32 weights + grads + 2 AdamW moments
    with pytest.raises(ValueError, match=r"^memory: this run needs at least 146\.\d GiB on cuda:0 .*"
                                         r"generator\.gpu_memory_utilization .*generator\.sleep .*trainer\.cpu_offload"):
        check_fits(est, free=79 * GIB, device="cuda:0")
    # Two ranks (layout b), bfloat16 masters, the engine asleep while the trainer steps: 8B fits on each 80 GB GPU.
    cfg.trainer = TrainerConfig(master_dtype="bfloat16")
    cfg.generator.sleep = "weights"
    est = estimate(cfg, shape, world_size=2, device_total=80 * GIB, role="colocated")
    check_fits(est, free=79 * GIB, device="cuda:0")
    assert est.train_peak < est.generate_peak < 79 * GIB


def test_a_run_that_cannot_fit_is_refused_in_one_line_before_it_starts(tmp_path):
    """Qwen3-8B's trainer state alone (131 GB in float32) exceeds this machine's memory: one line, no run folder."""
    proc = run_cli("--config", "run_configs/cpu_tiny.toml", "--model.flavor", "8B", "--job.output_dir", str(tmp_path))
    assert_one_line_error(proc, "memory: this run needs at least 138.", "trainer.master_dtype bfloat16",
                          prefix="torchtitan_rl: error: ")
    assert not any(tmp_path.iterdir())


def test_an_allocation_the_machine_refuses_becomes_one_line():
    """A real refusal of torch's CPU allocator (a petabyte); CUDA's OutOfMemoryError takes the same path on a GPU."""
    import torch

    with pytest.raises(ValueError, match=r"^memory: the host ran out of memory at step 3's train step \(.*\); make "
                                         r"room with trainer.master_dtype bfloat16") as e:
        with one_line_oom("step 3's train step"):
            torch.empty(1 << 50, dtype=torch.uint8)
    assert "\n" not in str(e.value)
    with pytest.raises(RuntimeError, match="other"):  # anything else passes through
        with one_line_oom("x"):
            raise RuntimeError("other")
