"""Run by test_data_parallel under torchrun (2 ranks, gloo, CPU).

argv: batch.pt out_dir. Writes out_dir/rank{r}.pt with what each phase saw.

FSDP (dp_shard=2, fp32 compute: see test_fsdp_step_equals_single_process_full_batch):
rank r takes rows SPLITS[r] of the global batch (uneven
on purpose: the ranks run different numbers of micro-batches), computes
logprobs, trains one step, gathers the full parameters; then a 2-rank
checkpoint round trip: save, step, reload into a new Trainer, step; then 2 epochs x 2 mini-batches
on an even split.

TP (tensor_parallel_degree=2): both ranks take the whole batch.

EP (tiny-moe, fp32): FSDP alone and expert_parallel_degree=2 on the same rows: the full parameters as the sync
gathers them (distributed/dtensor.full_many, as they are and cast to bf16), one step's gradients, then an EP
checkpoint round trip.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan_rl.config.job_config import (
    GRPOConfig,
    ModelConfig,
    ParallelismConfig,
    TrainerConfig,
)
from torchtitan_rl.distributed.dtensor import full_many
from torchtitan_rl.models.families import resolve_shape
from torchtitan_rl.trainer import TrainBatch, Trainer, checkpoint

SPLITS = [slice(0, 5), slice(5, 8)]


def main() -> None:
    batch_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    full = torch.load(batch_path)
    shape = resolve_shape(flavor="tiny", hf_checkpoint=None, vocab_size=16, max_seq_len=64)

    def make_trainer(dtype: str = "float32", **parallelism) -> Trainer:
        return Trainer(
            TrainerConfig(micro_batch_size=2, parallelism=ParallelismConfig(**parallelism)),
            model_config=ModelConfig(dtype=dtype), shape=shape,
            seed=0, device=torch.device("cpu"), output_dir=out_dir,
        )

    trainer = make_trainer()
    assert trainer.dp_size == 2 and trainer.dp_rank == dist.get_rank()
    rows = SPLITS[trainer.dp_rank]
    batch = TrainBatch(**{k: v[rows] for k, v in full.items()})
    grpo = GRPOConfig()
    logprobs = trainer.token_logprobs(batch.tokens_BL, temperature=1.0)
    metrics = trainer.train_step(batch, temperature=1.0, grpo=grpo)
    params = {k: v.full_tensor() for k, v in trainer.model.named_parameters()}

    trainer.save_checkpoint(1)
    second = trainer.train_step(batch, temperature=1.0, grpo=grpo)["loss"]
    resumed = make_trainer()
    resumed.load_checkpoint(checkpoint.newest_verified(resumed.checkpoint_folder)[1])
    second_resumed = resumed.train_step(batch, temperature=1.0, grpo=grpo)["loss"]

    # Epochs x mini-batches (rank r: rows [4r, 4r + 4), each rank's half is half of every mini-batch).
    epochs = make_trainer()
    even = TrainBatch(**{k: v[4 * dist.get_rank() : 4 * dist.get_rank() + 4] for k, v in full.items()})
    epoch_metrics = epochs.train_step(even, temperature=1.0, grpo=GRPOConfig(epochs=2, mini_batches=2))
    epoch_params = {k: v.full_tensor() for k, v in epochs.model.named_parameters()}

    tp = make_trainer("bfloat16", tensor_parallel_degree=2)
    assert tp.dp_size == 1
    whole = TrainBatch(**full)
    tp_logprobs = tp.token_logprobs(whole.tokens_BL, temperature=1.0)
    tp_metrics = tp.train_step(whole, temperature=1.0, grpo=grpo)

    moe = resolve_shape(flavor="tiny-moe", hf_checkpoint=None, vocab_size=16, max_seq_len=64)
    ep = {}
    for degree in (1, 2):
        experts = Trainer(
            TrainerConfig(micro_batch_size=2, parallelism=ParallelismConfig(expert_parallel_degree=degree)),
            model_config=ModelConfig(dtype="float32"), shape=moe, seed=0, device=torch.device("cpu"),
            output_dir=out_dir / f"ep{degree}",
        )
        names, tensors = zip(*experts.model.named_parameters())
        ep[degree] = {
            "params": dict(zip(names, full_many(list(tensors)))),
            "params_bf16": dict(zip(names, full_many(list(tensors), [torch.bfloat16] * len(tensors)))),
            "logprobs": experts.token_logprobs(batch.tokens_BL, temperature=1.0),
            "metrics": experts.train_step(batch, temperature=1.0, grpo=grpo),
            "grads": {name: t.grad.full_tensor() for name, t in zip(names, tensors)},
            "meshes": sorted({t.device_mesh.mesh_dim_names for t in tensors}),
        }
    experts.save_checkpoint(1)
    ep["second"] = experts.train_step(batch, temperature=1.0, grpo=grpo)["loss"]
    experts = Trainer(
        TrainerConfig(micro_batch_size=2, parallelism=ParallelismConfig(expert_parallel_degree=2)),
        model_config=ModelConfig(dtype="float32"), shape=moe, seed=0, device=torch.device("cpu"), output_dir=out_dir / "ep2",
    )
    experts.load_checkpoint(checkpoint.newest_verified(experts.checkpoint_folder)[1])
    ep["second_resumed"] = experts.train_step(batch, temperature=1.0, grpo=grpo)["loss"]

    torch.save(
        {"metrics": metrics, "params": params, "logprobs": logprobs,
         "second": second, "second_resumed": second_resumed,
         "tp_logprobs": tp_logprobs, "tp_metrics": tp_metrics,
         "epoch_metrics": epoch_metrics, "epoch_params": epoch_params, "ep": ep},
        out_dir / f"rank{dist.get_rank()}.pt",
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
