"""Run by test_distributed_sync under torchrun (2 ranks, gloo, CPU).

argv: out_dir. Rank 0 writes out_dir/result.json.

FSDP over both ranks: sync_state() holds DTensors sharded Shard(0), and only
rank 0 holds a vLLM generator. Every sync gathers the shards (a collective on
both ranks) and rank 0 writes them into the generator. What the generator
then samples is scored three ways: by the sharded trainer (each rank its own
rows), and by a single-process forward of the gathered weights. Twice: after
init (version 1) and after one train step on both ranks (version 2), where
the step-1 weights must no longer fit, so a stale or partial sync cannot pass.
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tests.helpers import PROMPTS, logprob_check, make_generator, tiny_shape, trainer_model
from torchtitan_rl.config import WeightSyncConfig
from torchtitan_rl.config.job_config import GRPOConfig, ModelConfig, TrainerConfig
from torchtitan_rl.grpo.batch import pack_rollouts
from torchtitan_rl.trainer import TrainBatch, Trainer
from torchtitan_rl.weight_sync.sync import WeightSync
from torchtitan_rl.distributed.dtensor import full_many

N = 2
"""Completions per prompt."""


def main() -> None:
    out_dir = Path(sys.argv[1])
    trainer = Trainer(
        TrainerConfig(), model_config=ModelConfig(), shape=tiny_shape(),
        seed=0, device=torch.device("cpu"), output_dir=out_dir,
    )
    rank = dist.get_rank()
    assert trainer.dp_size == 2 and trainer.dp_rank == rank
    layout = {
        k: {"global": list(t.shape), "local": list(t.to_local().shape), "placements": str(t.placements)}
        for k, t in trainer.sync_state().items()
        if isinstance(t, DTensor)
    }
    plain = {k: list(t.shape) for k, t in trainer.sync_state().items() if not isinstance(t, DTensor)}

    # After the trainer: the engine is then built inside engine/in_process.py's _private_world,
    # so vLLM's group setup on rank 0 does not wait for rank 1.
    generator = make_generator(out_dir / "generator") if rank == 0 else None
    sync = WeightSync(WeightSyncConfig(), reference=trainer.sync_state(), generator=generator)

    rows = slice(rank * len(PROMPTS) * N // 2, (rank + 1) * len(PROMPTS) * N // 2)
    versions, previous_model = [], None
    for version in (1, 2):
        stats = sync.sync(trainer.sync_state(), version=version)
        if version == 1:  # the generator holds exactly the bits of the whole fp32 tensors cast after the gather
            whole = dict(zip(sync.keys, full_many([trainer.sync_state()[k] for k in sync.keys])))
            same_bits = rank != 0 or all(
                torch.equal(e.dest, whole[e.source].view(e.dest.shape).to(e.dest.dtype)) for e in sync.plan.entries)
            wire = sorted({str(d) for d in sync.wire.values()})
        payload = [generator.generate(PROMPTS, n=N, seed=version) if rank == 0 else None]
        dist.broadcast_object_list(payload, src=0)
        rollouts = payload[0]
        tokens_BL, mask_BL, gen_lp_BL = pack_rollouts(
            rollouts.prompt_ids, rollouts.completion_ids, rollouts.logprobs, pad_id=0
        )
        trainer_lp_BL = trainer.token_logprobs(tokens_BL[rows], temperature=1.0)
        gathered = [torch.empty_like(trainer_lp_BL) for _ in range(2)]
        dist.all_gather(gathered, trainer_lp_BL)
        # The full weights, as one process would hold them (a collective).
        full = {k: v.full_tensor() for k, v in trainer.model.named_parameters()}

        record = None
        if rank == 0:
            model = trainer_model(seed=0)
            params = dict(model.named_parameters())  # tied weights once, as the trainer's
            assert params.keys() == full.keys(), (params.keys() ^ full.keys())
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(full[k])
            mask = mask_BL.bool()
            all_lp_BL = torch.cat(gathered)
            record = {
                "version": version,
                "rollout_version": rollouts.weight_version,
                "bytes_written": stats.bytes_written,
                "tensors_verified": stats.tensors_verified,
                "scored_tokens": int(mask.sum()),
                "gen_vs_sharded_trainer": (all_lp_BL - gen_lp_BL).abs()[mask].mean().item(),
                "gen_vs_single_process": dataclasses.asdict(logprob_check(rollouts, model)),
                "gen_vs_previous_weights": (
                    logprob_check(rollouts, previous_model).error if previous_model is not None else None
                ),
            }
            previous_model = model
        versions.append(record)

        if version == 1:  # one optimizer step on both ranks, each on its own rows
            advantages_B = torch.tensor([1.0, -1.0] * len(PROMPTS))
            metrics = trainer.train_step(
                TrainBatch(tokens_BL[rows], mask_BL[rows], trainer_lp_BL, advantages_B[rows]),
                temperature=1.0, grpo=GRPOConfig(),
            )

    layouts, wires = [None, None], [None, None]
    dist.all_gather_object(layouts, layout)
    dist.all_gather_object(wires, wire)
    batched = check_full_many(trainer)
    if rank == 0:
        result = {"layouts": layouts, "unsharded": plain, "versions": versions, "train_metrics": metrics,
                  "full_many": batched, "same_bits": same_bits, "wire": wires}
        (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    # No destroy_process_group: vLLM's exit hook on rank 0 tears down its own
    # groups, which must then still be valid.
    dist.barrier()


def check_full_many(trainer) -> dict:
    """full_many's one all-gather per bucket against full_tensor() per tensor, bit for bit:
    the trainer's state, uneven rows (5 over 2 ranks), a rank with an empty shard (1 row),
    a 1-D tensor, and a cast to bf16 on the way."""
    mesh = next(iter(trainer.sync_state().values())).device_mesh
    g = torch.Generator().manual_seed(7)
    odd = [torch.randn(*shape, generator=g) for shape in ((5, 3), (1, 4), (7,))]
    odd = [distribute_tensor(t, mesh, [Shard(0)]) for t in odd]
    state = list(trainer.sync_state().values())
    tensors = state + odd
    dtypes = [torch.float32] * len(state) + [torch.float32, torch.bfloat16, torch.float32]
    got = full_many(tensors, dtypes)
    want = [(t.full_tensor() if isinstance(t, DTensor) else t).to(d) for t, d in zip(tensors, dtypes)]
    return {
        "tensors": len(tensors),
        "equal": all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want)),
    }


if __name__ == "__main__":
    main()
