"""Run by test_nccl_transport under torchrun: 2 + R processes, gloo, CPU.

argv: out_dir [flavor: tiny (Qwen3, default) or tiny-llama] [replicas R, default 1]. Ranks 0 and 1 are an FSDP
trainer (their default process group has 2 ranks), ranks 2..2+R-1 are generator replicas (vLLM in process
each), fed by one broadcast group. Rank 0 writes out_dir/result.json, replica r out_dir/generator{r}.json.

1. sync version 1 (4 KiB buckets: many buckets, both buffers reused);
   every replica samples the same prompts and seeds, the trainer scores
   each replica's tokens.
2. a NaN in one shard on rank 1 only: the first buckets go out while the
   scan runs, its verdict rejects the sync on both trainer ranks and on
   every replica, which wrote nothing: each still serves version 1 and
   samples exactly what it did before.
3. new weights, version 2, received on a background thread while the
   trainer holds the data back for 1 s; generate() is called once the sync
   has begun and must wait for it, then serve version 2.
"""

import json
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers import PROMPTS, make_generator, tiny_shape
from torchtitan_rl.config import WeightSyncConfig
from torchtitan_rl.config.job_config import ModelConfig, TrainerConfig
from torchtitan_rl.rollout.base import Rollouts
from torchtitan_rl.grpo.batch import pack_rollouts
from torchtitan_rl.trainer import Trainer
from torchtitan_rl.distributed.world import init_world
from torchtitan_rl.weight_sync.nccl_receiver import NcclReceiver
from torchtitan_rl.weight_sync.nccl_sender import NcclSender
from torchtitan_rl.weight_sync.buckets import bucket_keys

N = 2
"""Completions per prompt."""
HOLD_S = 1.0
"""How long the trainer holds the data of sync 2 back after its header."""


def put(world, key: str, value) -> None:
    world.store.set(f"test/{key}", json.dumps(value))


def put_rollouts(world, key: str, rollouts: Rollouts) -> None:
    """The trace stays behind: it is the engine's timing, which the trainer ranks never compare."""
    put(world, key, rollouts.__dict__ | {"trace": None})


def get(world, key: str):
    world.store.wait([f"test/{key}"])
    return json.loads(world.store.get(f"test/{key}"))


def generator_main(world, out_dir: Path, flavor: str) -> None:
    r = world.replica
    gen = make_generator(out_dir / f"generator{r}", flavor=flavor, wait_for_weights_s=60.0)
    receiver = NcclReceiver(generator=gen, world=world)
    record = {"plan_entries": len(receiver.plan.entries), "constants": len(receiver.plan.constants),
              "default_world": dist.get_world_size(), "replica": r}

    stats = receiver.receive()
    record["sync1"] = {"version": stats.version, "bytes": stats.bytes_written, "verified": stats.tensors_verified}
    r1 = gen.generate(PROMPTS, n=N, seed=1)
    put_rollouts(world, f"r1/{r}", r1)

    t0 = time.perf_counter()
    rejected = receiver.receive()  # drains the buckets sent ahead of the verdict
    get(world, "rejected")
    record["after_reject"] = {
        "version": gen.weight_version, "syncs": receiver.syncs, "rejected": rejected.rejected,
        "written": rejected.bytes_written, "receive_s": time.perf_counter() - t0,
    }
    again = gen.generate(PROMPTS, n=N, seed=1)
    record["after_reject"]["same_completions"] = again.completion_ids == r1.completion_ids
    put_rollouts(world, f"r1_again/{r}", again)

    result = {}
    thread = threading.Thread(target=lambda: result.update(stats=receiver.receive()))
    thread.start()
    assert receiver.syncing.wait(60), "sync 2 never began"
    t0 = time.perf_counter()
    r2 = gen.generate(PROMPTS, n=N, seed=1)
    record["race"] = {
        "waited_s": time.perf_counter() - t0,
        "rollout_version": r2.weight_version,
        "version_after": gen.weight_version,
    }
    thread.join()
    record["sync2"] = {"version": result["stats"].version, "bytes": result["stats"].bytes_written}
    put_rollouts(world, f"r2/{r}", r2)
    (out_dir / f"generator{r}.json").write_text(json.dumps(record, indent=1))
    get(world, "done")


def score(trainer, rollouts: Rollouts) -> float:
    """Mean |generator - trainer| logprob over the sampled tokens (every trainer rank scores all rows)."""
    tokens_BL, mask_BL, gen_BL = pack_rollouts(
        rollouts.prompt_ids, rollouts.completion_ids, rollouts.logprobs, pad_id=0
    )
    trainer_BL = trainer.token_logprobs(tokens_BL, temperature=1.0)
    return (trainer_BL - gen_BL).abs()[mask_BL.bool()].mean().item()


def trainer_main(world, out_dir: Path, flavor: str) -> None:
    trainer = Trainer(
        TrainerConfig(), model_config=ModelConfig(), shape=tiny_shape(flavor),
        seed=0, device=torch.device("cpu"), output_dir=out_dir,
    )
    rank = dist.get_rank()
    record = {"trainer_world": dist.get_world_size(), "dp_size": trainer.dp_size}
    sender = NcclSender(WeightSyncConfig(verify="full"), reference=trainer.sync_state(), world=world,
                        bucket_bytes=4096)
    record["buckets"] = len(bucket_keys(sender.ws.keys, sender.nbytes, sender.bucket_bytes))

    replicas = range(world.replicas)
    record["replicas"] = world.replicas
    stats = sender.sync(trainer.sync_state(), version=1)
    record["sync1"] = {"bytes": stats.bytes_written, "verified": stats.tensors_verified}
    r1 = [get(world, f"r1/{r}") for r in replicas]
    record["v1_gen_vs_trainer"] = [score(trainer, Rollouts(**x)) for x in r1]
    # Same weights, prompts and seeds, same batch: every replica's samples and logprobs, bit for bit.
    record["replicas_agree"] = all(
        (x["completion_ids"], x["logprobs"], x["weight_version"]) ==
        (r1[0]["completion_ids"], r1[0]["logprobs"], r1[0]["weight_version"]) for x in r1
    )

    # A NaN in rank 1's shard only: the sender (rank 0) holds clean shards.
    key = "layers.1.feed_forward.w2.weight"
    local = trainer.sync_state()[key].to_local()
    saved = local.view(-1)[3].item()
    with torch.no_grad():
        if rank == 1:
            local.view(-1)[3] = float("nan")
        try:
            sender.sync(trainer.sync_state(), version=2)
            record["nan_rejected"] = None
        except ValueError as e:
            record["nan_rejected"] = str(e)
        local.view(-1)[3] = saved
    record["syncs_after_reject"] = sender.syncs
    if rank == 0:
        put(world, "rejected", True)
    record["after_reject_gen_vs_trainer"] = [
        score(trainer, Rollouts(**get(world, f"r1_again/{r}"))) for r in replicas
    ]

    # New weights everywhere; the data of sync 2 is held back so the generator's call races it.
    locals_ = [p.to_local() for p in trainer.model.parameters()]
    v1 = [t.detach().clone() for t in locals_]
    torch.manual_seed(100 + rank)
    with torch.no_grad():
        for t in locals_:
            t.add_(0.03 * torch.randn_like(t))
    if rank == 0:
        real_send = sender._send

        def held_send(*args, **kwargs):
            time.sleep(HOLD_S)
            return real_send(*args, **kwargs)

        sender._send = held_send
    stats = sender.sync(trainer.sync_state(), version=2)
    record["sync2"] = {"bytes": stats.bytes_written, "verified": stats.tensors_verified}
    r2 = [Rollouts(**get(world, f"r2/{r}")) for r in replicas]
    record["v2_gen_vs_trainer"] = [score(trainer, x) for x in r2]
    with torch.no_grad():
        v2 = [t.detach().clone() for t in locals_]
        torch._foreach_copy_(locals_, v1)
        record["v2_rollouts_vs_v1_trainer"] = [score(trainer, x) for x in r2]
        torch._foreach_copy_(locals_, v2)
    if rank == 0:
        (out_dir / "result.json").write_text(json.dumps(record, indent=1))
        put(world, "done", True)
    dist.barrier()


def main() -> None:
    out_dir = Path(sys.argv[1])
    flavor = sys.argv[2] if len(sys.argv) > 2 else "tiny"
    replicas = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    world = init_world("cpu", replicas=replicas)
    if world.role == "generator":
        generator_main(world, out_dir, flavor)
    else:
        trainer_main(world, out_dir, flavor)


if __name__ == "__main__":
    main()
