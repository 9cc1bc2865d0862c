"""One trainer's host memory, measured (python tests/trainer/memory_worker.py FLAVOR MASTER_DTYPE): JSON on stdout
with the RSS growth from before the Trainer to after its first optimizer step and the estimate of the same run."""

import gc
import json
import sys
import tempfile
from pathlib import Path

import torch

from torchtitan_rl.config import JobConfig
from torchtitan_rl.config.job_config import ModelConfig, TrainerConfig
from torchtitan_rl.grpo.loss import grpo_loss  # noqa: F401  (imported before the baseline, as the Trainer does)
from torchtitan_rl.run.memory import estimate
from torchtitan_rl.models.families import resolve_shape
from torchtitan_rl.trainer import TrainBatch, Trainer


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no {field}")


def rss() -> int:
    return status_bytes("VmRSS")


BUILD_PEAK = [0]
"""The process's peak RSS while the measured Trainer is built (its first step not taken yet)."""


def one_step(cfg: JobConfig, shape, *, measure_build: bool = False) -> Trainer:
    if measure_build:  # the peak so far (imports, a first step's compile in a fresh checkout) is not the build's
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    trainer = Trainer(cfg.trainer, model_config=cfg.model, shape=shape, seed=0, device=torch.device("cpu"),
                      output_dir=Path(tempfile.mkdtemp()))
    if measure_build:
        BUILD_PEAK[0] = status_bytes("VmHWM")
    tokens_BL = torch.randint(1, min(1000, shape.vocab_size), (2, 16))
    mask_BL = torch.zeros(2, 16)
    mask_BL[:, 8:] = 1
    batch = TrainBatch(tokens_BL=tokens_BL, loss_mask_BL=mask_BL, old_logprobs_BL=-5.0 * mask_BL,
                       advantages_B=torch.tensor([1.0, -1.0]))
    trainer.train_step(batch, temperature=1.0, grpo=cfg.grpo, max_tokens=8)
    return trainer


def main(flavor: str, master_dtype: str) -> None:
    torch.set_num_threads(1)
    shape = resolve_shape(flavor=flavor, hf_checkpoint=None, vocab_size=0, max_seq_len=64)
    cfg = JobConfig(model=ModelConfig(flavor=flavor), trainer=TrainerConfig(master_dtype=master_dtype))
    est = estimate(cfg, shape, world_size=1, device_total=0, role="trainer")
    # The modules a first step imports, and in a fresh checkout compiles, are not the trainer's memory: a tiny
    # trainer's step takes them before the baseline (measured 1.29x instead of 1.13x when this worker ran first).
    tiny = resolve_shape(flavor="tiny", hf_checkpoint=None, vocab_size=16, max_seq_len=64)
    one_step(JobConfig(model=ModelConfig(flavor="tiny", vocab_size=16), trainer=cfg.trainer), tiny)
    gc.collect()
    before = rss()
    trainer = one_step(cfg, shape, measure_build=True)  # held until the RSS is read
    after = rss()
    del trainer
    print(json.dumps({"measured": after - before, "estimate": est.trainer_resident, "summary": est.summary(),
                      "build_measured": BUILD_PEAK[0] - before, "build_estimate": est.trainer_build}))


if __name__ == "__main__":
    main(*sys.argv[1:])
