"""Weight sync to R generator replicas by one broadcast: how its time grows with R.

One launch measures one R: torchrun with 1 + R processes, rank 0 the trainer
(torchtitan_rl's Trainer on one rank, fp32 masters), ranks 1..R one generator
replica each (torchtitan's Qwen3 in vLLM, in process, dummy weights), joined by
distributed/world.py's ``init_world(replicas=R)``. Per model shape:

1. ours: NcclSender.sync -> every replica's NcclReceiver.receive (names/shapes
   check, header, flat bf16 buckets broadcast to the group, the NaN/inf
   verdict, checksums, each replica's answer); timed on the trainer from the
   call until the last replica answered;
2. the wire alone: back-to-back broadcasts of the same bytes over the same
   group (trainer rank 0 + all replicas), no handshake.

Results are merged by (model, R) into --json, and the table of every R in it
goes to docs/benchmarks.md, so a sweep is one launch per R:

    for R in 1 2 3 7; do torchrun --nproc-per-node $((R + 1)) scripts/bench_replica_sync.py \\
        --flavors 0.6B 8B --json replicas.json; done            # GPUs: one per process
    for R in 1 2 3; do torchrun --nproc-per-node $((R + 1)) scripts/bench_replica_sync.py \\
        --device cpu --flavors tiny debugmodel --json /tmp/replicas_cpu.json; done   # gloo smoke test
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import BENCHMARKS_MD, synchronize, table, write_section  # noqa: E402

from torchtitan_rl import compat  # noqa: E402  (import before torchtitan)
from torchtitan_rl.config import GeneratorConfig, ModelConfig, WeightSyncConfig  # noqa: E402
from torchtitan_rl.config.job_config import TrainerConfig  # noqa: E402
from torchtitan_rl.models.families import resolve_shape  # noqa: E402
from torchtitan_rl.distributed.world import broadcast, init_world  # noqa: E402
from torchtitan_rl.weight_sync.nccl_receiver import NcclReceiver  # noqa: E402
from torchtitan_rl.weight_sync.nccl_sender import NcclSender  # noqa: E402
from torchtitan_rl.weight_sync.store import get_text  # noqa: E402


def shape_of(flavor: str, args):
    return resolve_shape(flavor=flavor, hf_checkpoint=None, vocab_size=16 if flavor == "tiny" else 0,
                         max_seq_len=args.max_seq_len)


def trainer_flavor(world, flavor: str, args, workdir: Path) -> dict:
    from torchtitan_rl.trainer import Trainer

    device = world.device
    trainer = Trainer(TrainerConfig(), model_config=ModelConfig(flavor=flavor, max_seq_len=args.max_seq_len),
                      shape=shape_of(flavor, args), seed=0, device=device, output_dir=workdir)
    state = trainer.sync_state()
    sender = NcclSender(WeightSyncConfig(bucket_mb=args.bucket_mb), reference=state, world=world, name=flavor,
                        timeout_s=args.startup_timeout)
    times = []
    for i in range(1 + args.warmup + args.repeats):  # the first moves the RoPE buffers too
        synchronize(device.type)
        stats = sender.sync(state, version=i + 1)
        times.append(stats.seconds)
    nbytes = stats.bytes_written  # steady state: the parameters
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    world.store.set(f"bench/{flavor}/bytes", str(nbytes))
    for _ in range(2):
        broadcast(world.group, flat, root=0).wait()
    synchronize(device.type)
    get_text(world.store, f"bench/{flavor}/ready", args.startup_timeout)  # every replica's receives posted
    start = time.perf_counter()
    for _ in range(args.repeats):
        broadcast(world.group, flat, root=0).wait()
    synchronize(device.type)
    wire = (time.perf_counter() - start) / args.repeats
    return {
        "flavor": flavor, "replicas": world.replicas, "n_params": sum(p.numel() for p in trainer.model.parameters()),
        "bytes": nbytes, "ours_s": statistics.median(times[1 + args.warmup:]), "wire_s": wire,
    }


def generator_flavor(world, flavor: str, args, workdir: Path) -> None:
    from torchtitan_rl.engine.engine import Engine

    with compat.vllm_device(world.device):
        gen = Engine(
            GeneratorConfig(max_model_len=args.max_seq_len, max_num_seqs=16, enforce_eager=True,
                            gpu_memory_utilization=args.gpu_memory_utilization),
            model_config=ModelConfig(flavor=flavor, max_seq_len=args.max_seq_len), shape=shape_of(flavor, args),
            seed=0, device=world.device.type, workdir=workdir / f"{flavor}_replica{world.replica}",
        )
    receiver = NcclReceiver(generator=gen, world=world, name=flavor)
    for _ in range(1 + args.warmup + args.repeats):
        receiver.receive()
    flat = torch.empty(int(get_text(world.store, f"bench/{flavor}/bytes", None)), dtype=torch.uint8,
                       device=world.device)
    for _ in range(2):
        broadcast(world.group, flat, root=0).wait()
    synchronize(world.device.type)
    works = [broadcast(world.group, flat, root=0) for _ in range(args.repeats)]
    if world.store.add(f"bench/{flavor}/posted", 1) == world.replicas:  # the last replica to post
        world.store.set(f"bench/{flavor}/ready", "1")
    for w in works:
        w.wait()
    synchronize(world.device.type)


def report(results: list[dict], args) -> None:
    one = {r["flavor"]: r for r in results if r["replicas"] == 1}
    rows = []
    for r in sorted(results, key=lambda r: (r["n_params"], r["replicas"])):
        base = one.get(r["flavor"])
        rows.append([
            r["flavor"], f"{r['n_params'] / 1e6:.1f} M", r["replicas"], f"{r['bytes'] / 2**20:.1f}",
            f"{r['ours_s'] * 1e3:.2f}", f"{r['wire_s'] * 1e3:.2f}", f"{r['bytes'] / r['ours_s'] / 1e9:.1f}",
            f"{r['ours_s'] / base['ours_s']:.2f}x" if base else "",
        ])
    body = table(["model", "params", "replicas R", "MiB per sync", "ours ms (median)", "wire ms",
                  "ours GB/s (sender's bytes)", "ours vs R = 1"], rows)
    body += (
        f"\nLayout: torchrun, 1 + R processes; rank 0 = the trainer (one rank, fp32 masters), ranks 1..R = one "
        f"generator replica each (torchtitan's Qwen3 in vLLM, in process, eager), one broadcast group of all of "
        f"them; random weights; {args.bucket_mb} MiB buckets, verify=sampled; ours = median of {args.repeats} "
        f"syncs after {args.warmup} warm-up, end to end on the trainer until the last replica answered; wire = "
        f"back-to-back broadcasts of the same bytes to the same group. Bytes are the sender's: each replica "
        f"receives all of them. One launch per R; rows merged from {args.json}.\n"
    )
    device = "cuda" if args.device == "cuda" else "cpu"
    if device == "cpu":
        body += (
            "\nOn CPU (gloo) this is a smoke test of the path, not of a link: the 1 + R processes share the "
            "machine's cores, so each replica's host work (unpack, checksums, answer) competes with the others' "
            "and with the sender's.\n"
        )
    write_section(f"Weight sync to R generator replicas, one broadcast ({device})", device=device, body=body,
                  path=Path(args.md))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavors", nargs="+", default=["0.6B", "8B"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--json", required=True, help="results of every R so far (read, merged, rewritten)")
    parser.add_argument("--md", default=str(BENCHMARKS_MD), help="where the table goes")
    args = parser.parse_args()

    replicas = int(os.environ["WORLD_SIZE"]) - 1
    world = init_world(args.device, replicas=replicas)
    workdir = Path(tempfile.mkdtemp(prefix="bench_replicas_"))
    for flavor in args.flavors:
        if world.role == "trainer":
            res = trainer_flavor(world, flavor, args, workdir)
            print(json.dumps(res), flush=True)
            path = Path(args.json)
            results = json.loads(path.read_text()) if path.exists() else []
            results = [r for r in results if (r["flavor"], r["replicas"]) != (flavor, replicas)] + [res]
            path.write_text(json.dumps(results, indent=1))
            report(results, args)
        else:
            generator_flavor(world, flavor, args, workdir)
    if world.role == "trainer":
        world.store.set("bench/end", "1")
    else:
        get_text(world.store, "bench/end", None)
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's in-process engine teardown


if __name__ == "__main__":
    main()
