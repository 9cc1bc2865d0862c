"""Run by tests/test_disk_full.py under torchrun (2 ranks, FSDP, gloo, CPU).

argv: out_dir (on a small tmpfs) result_dir. Saves a checkpoint after every step until a save fails;
writes result_dir/rank{r}.txt: how the failed save ended on this rank ("ValueError: ..." or "SystemExit: N").
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.trainer.helpers import make_batch
from torchtitan_rl.config.job_config import CheckpointConfig, GRPOConfig, ModelConfig, TrainerConfig
from torchtitan_rl.distributed.process_group import init_process_group
from torchtitan_rl.models.families import resolve_shape
from torchtitan_rl.trainer import Trainer


def main() -> None:
    out_dir, result_dir = Path(sys.argv[1]), Path(sys.argv[2])
    init_process_group(torch.device("cpu"), timeout_s=60)
    shape = resolve_shape(flavor="tiny", hf_checkpoint=None, vocab_size=16, max_seq_len=64)
    config = TrainerConfig(micro_batch_size=2, checkpoint=CheckpointConfig(keep_latest=1))
    trainer = Trainer(config, model_config=ModelConfig(dtype="float32"), shape=shape, seed=0,
                      device=torch.device("cpu"), output_dir=out_dir)
    assert trainer.dp_size == 2
    batch = make_batch(seed=dist.get_rank())
    ended = "saved every step"
    for step in range(1, 20):
        trainer.train_step(batch, temperature=1.0, grpo=GRPOConfig())
        try:
            trainer.save_checkpoint(step)
        except ValueError as e:
            ended = f"ValueError: {e}"
            break
        except SystemExit as e:
            ended = f"SystemExit: {e.code}"
            break
    (result_dir / f"rank{dist.get_rank()}.txt").write_text(ended)
    dist.barrier()  # both ranks left the failed save: neither waits in it for the other
    os._exit(0)  # as RankExits ends a run after a failure: no teardown (gloo's threads can abort one, 1 in 3 here)


if __name__ == "__main__":
    main()
