"""Run by test_hf_weights under torchrun (2 ranks, gloo, CPU). argv: out_dir hf_dir...

For each HF folder: a Trainer whose ranks each read only their shards (the default) and one whose ranks each
read the whole checkpoint; rank 0 writes out_dir/<i>.pt with both models' full parameters."""

import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan_rl.config.job_config import ModelConfig, TrainerConfig
from torchtitan_rl.distributed.dtensor import full
from torchtitan_rl.models.families import resolve_shape
from torchtitan_rl.trainer import Trainer


def full_params(sharded_hf_load: bool, hf_dir: str) -> dict[str, torch.Tensor]:
    shape = resolve_shape(flavor="tiny", hf_checkpoint=hf_dir, vocab_size=0, max_seq_len=64)
    trainer = Trainer(TrainerConfig(), model_config=ModelConfig(hf_checkpoint=hf_dir), shape=shape, seed=1,
                      device=torch.device("cpu"), output_dir=Path(tempfile.mkdtemp()),
                      sharded_hf_load=sharded_hf_load)
    assert all(p.to_local().shape[0] < p.shape[0] for p in trainer.model.parameters() if p.shape[0] > 1)
    return {k: full(v) for k, v in trainer.sync_state().items()}


def main() -> None:
    out_dir = Path(sys.argv[1])
    for i, hf_dir in enumerate(sys.argv[2:]):
        sharded, whole = full_params(True, hf_dir), full_params(False, hf_dir)
        if dist.get_rank() == 0:
            torch.save({"sharded": sharded, "whole": whole}, out_dir / f"{i}.pt")
    # Left to interpreter teardown, gloo's threads can abort a finished rank ("terminate called without an active
    # exception", seen in CI on 2026-11-28): the group goes first, as simple_grpo's does.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
