"""Weight sync to a generator on its own GPU: ours vs a raw NCCL broadcast vs vLLM's NCCL engine.

Run under torchrun with 2 processes: rank 0 is the trainer (torchtitan_rl's
Trainer: FSDP2 over its own one-rank default group, fp32 master weights) on
cuda:0, rank 1 the generator (torchtitan's Qwen3 inside vLLM, in process) on
cuda:1; distributed/world.py's init_world sets that up. Per model shape
(random weights):

1. correctness on this layout: sync, sample, score the same tokens with the
   trainer; perturb every weight, sync again, sample and score again (and
   score the new rollouts with the old weights: they must not fit);
2. ours (NcclSender -> NcclReceiver): names/shapes check, header, flat
   double-buffered bf16 buckets with the NaN/inf scan overlapped (its verdict
   follows the first two buckets), checksums, the generator's answer; timed on the trainer from
   the call to its return (the generator has published the version by then);
3. a raw NCCL broadcast of the same bytes (one flat bf16 buffer, trainer ->
   generator, same two-rank group), with the same store handshake as ours
   (header, answer) and without it (back-to-back broadcasts: the wire alone);
4. vLLM's NCCL weight-transfer engine (vllm/distributed/weight_transfer/
   nccl_engine.py): its trainer side (trainer_init, trainer_send_weights,
   packed, double-buffered) on rank 0, and on rank 1 an in-process vLLM
   engine of vLLM's native Qwen3 with weight_transfer_config=nccl driven
   through collective_rpc (init_weight_transfer_engine, start_weight_update,
   update_weights, finish_weight_update), fed the same weights in HF names
   and cast to bf16 by the trainer in the timed region. Runs last (after every
   shape's other numbers are written).

    torchrun --nproc-per-node 2 scripts/bench_nccl_sync.py --flavors 0.6B 1.7B --json out.json
    torchrun --nproc-per-node 2 scripts/bench_nccl_sync.py --device cpu --flavors tiny  # gloo smoke test
"""

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import BENCHMARKS_MD, synchronize, table, write_section  # noqa: E402

from torchtitan_rl import compat  # noqa: E402  (import before torchtitan)
from torchtitan_rl.config import GeneratorConfig, ModelConfig, SamplingConfig, WeightSyncConfig  # noqa: E402
from torchtitan_rl.config.job_config import TrainerConfig  # noqa: E402
from torchtitan_rl.grpo.batch import pack_rollouts  # noqa: E402
from torchtitan_rl.models.families import resolve_shape  # noqa: E402
from torchtitan_rl.models.shape import build_titan_model  # noqa: E402
from torchtitan_rl.distributed.world import broadcast, init_world  # noqa: E402
from torchtitan_rl.weight_sync.nccl_receiver import NcclReceiver  # noqa: E402
from torchtitan_rl.weight_sync.nccl_sender import NcclSender  # noqa: E402
from torchtitan_rl.weight_sync.store import get_text  # noqa: E402

RAY_STUB = Path(__file__).resolve().parent / "gpu" / "stubs"
"""vLLM 0.26's weight_transfer package may import ray; the GPU image has none."""
RAW = "raw NCCL broadcast, same bytes, one flat buffer, same handshake as ours"
WIRE = "raw NCCL broadcast, same bytes, back to back (the wire alone)"
VLLM = "vLLM NCCL weight-transfer engine (packed, 2 x 1 GiB buffers, native Qwen3 + layerwise reload)"


class Channel:
    """Small JSON messages between the two ranks through the job's store."""

    def __init__(self, world, prefix: str):
        self.store = dist.PrefixStore(f"bench/{prefix}", world.store)

    def put(self, key: str, value) -> None:
        self.store.set(key, json.dumps(value))

    def get(self, key: str, timeout_s: float | None = None):
        value = get_text(self.store, key, timeout_s)
        return None if value is None else json.loads(value)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def ours_configs(args) -> list[tuple[str, int, str, str]]:
    """(label, bucket MiB, verify, scan) rows; the first is the default configuration.

    scan: where the NaN/inf scan runs. "side" (the default: a side stream, its
    verdict after the first two buckets), and with --scan-variants "current"
    (the current stream, ahead of the first pack, verdict as before) and
    "before" (validated with a host sync before the header: the pre-overlap
    design), to show what the overlap buys on this machine.
    """
    rows = [(f"ours, {args.buckets[0]} MiB buckets, verify=sampled", args.buckets[0], "sampled", "side")]
    rows += [(f"ours, {b} MiB buckets, verify=sampled", b, "sampled", "side") for b in args.buckets[1:]]
    rows.append((f"ours, {args.buckets[0]} MiB buckets, verify=full", args.buckets[0], "full", "side"))
    if args.scan_variants:
        for b in args.buckets:
            rows.append((f"ours, {b} MiB buckets, verify=sampled, scan on the current stream", b, "sampled", "current"))
            rows.append((f"ours, {b} MiB buckets, verify=sampled, scan before sending (host sync)", b, "sampled",
                         "before"))
    return rows


PROFILED_SYNCS = 3


@contextlib.contextmanager
def profiled(path: Path, device: torch.device):
    """torch.profiler around the block; the top ops by self CPU and by device time go to ``path``."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield
        synchronize(device.type)
    table = prof.key_averages()
    text = f"{PROFILED_SYNCS} syncs\n" + table.table(sort_by="self_cpu_time_total", row_limit=30)
    if device.type == "cuda":
        text += "\n" + table.table(sort_by="self_cuda_time_total", row_limit=30)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def scan_variant(sender: NcclSender, scan: str):
    """A replacement for sender._scan (see ours_configs)."""
    ws = sender.ws
    if scan == "current":
        return ws.problem_flags
    if scan == "before":
        def before(state, keys):
            ws.validate(state, keys)
            return torch.zeros(len(keys) + len(ws.aliases), dtype=torch.uint8, device=sender.world.device)
        return before
    return NcclSender._scan.__get__(sender)


# ----------------------------------------------------------------------- trainer


def compare(trainer, rollouts: dict, pad_id: int = 0) -> dict:
    tokens_BL, mask_BL, gen_BL = pack_rollouts(
        rollouts["prompt_ids"], rollouts["completion_ids"], rollouts["logprobs"], pad_id=pad_id
    )
    trainer_BL = trainer.token_logprobs(tokens_BL, temperature=1.0).cpu()
    diff = (trainer_BL - gen_BL).abs()[mask_BL.bool()]
    return {"tokens": int(diff.numel()), "max": diff.max().item(), "mean": diff.mean().item(),
            "p99": diff.quantile(0.99).item()}


def trainer_flavor(world, flavor: str, args, workdir: Path) -> dict:
    from torchtitan_rl.trainer import Trainer

    ch = Channel(world, flavor)
    device = world.device
    shape = resolve_shape(flavor=flavor, hf_checkpoint=None, vocab_size=16 if flavor == "tiny" else 0,
                          max_seq_len=args.max_seq_len)
    res: dict = {"flavor": flavor, "times": {}, "errors": {}}
    t = time.perf_counter()
    trainer = Trainer(TrainerConfig(), model_config=ModelConfig(flavor=flavor, max_seq_len=args.max_seq_len),
                      shape=shape, seed=0, device=device, output_dir=workdir)
    res["trainer_build_s"] = time.perf_counter() - t
    state = trainer.sync_state()
    res["n_params"] = sum(p.numel() for p in trainer.model.parameters())
    t = time.perf_counter()
    sender = NcclSender(WeightSyncConfig(), reference=state, world=world, name=flavor, timeout_s=args.startup_timeout)
    res["sender_init_s"] = time.perf_counter() - t  # waits for the generator's plan (engine start included)
    version = iter(range(1, 1_000_000))

    # 1. Correctness: the generator samples after each sync, the trainer scores.
    stats = sender.sync(state, version=next(version))
    res["first_sync"] = {"s": stats.seconds, "bytes": stats.bytes_written}
    res["v1"] = compare(trainer, ch.get("r1"))
    locals_ = [p.to_local() for p in trainer.model.parameters()]
    v1 = [x.detach().clone() for x in locals_]
    torch.manual_seed(123)
    with torch.no_grad():
        for x in locals_:
            x.add_(0.02 * torch.randn_like(x))
    sender.sync(state, version=next(version))
    r2 = ch.get("r2")
    res["v2"] = compare(trainer, r2)
    with torch.no_grad():
        v2 = [x.detach().clone() for x in locals_]
        torch._foreach_copy_(locals_, v1)
        res["v2_rollouts_vs_v1_trainer"] = compare(trainer, r2)
        torch._foreach_copy_(locals_, v2)
    del v1, v2
    res["completions_changed"] = ch.get("changed")

    # 2. Ours, per configuration (the generator follows the header of each sync).
    base = WeightSyncConfig()
    for label, bucket_mb, verify, scan in ours_configs(args):
        sender.config = dataclasses.replace(base, verify=verify)
        sender.bucket_bytes = bucket_mb << 20
        sender._scan = scan_variant(sender, scan)
        times = []
        for i in range(args.warmup + args.repeats):
            synchronize(device.type)
            t = time.perf_counter()
            stats = sender.sync(state, version=next(version))
            times.append(time.perf_counter() - t)
        res["times"][label] = median(times[args.warmup:])
    sender._scan = scan_variant(sender, "side")
    if args.profile:
        sender.config, sender.bucket_bytes = base, ours_configs(args)[0][1] << 20
        with profiled(Path(args.profile) / f"profile_trainer_{flavor}.txt", device):
            for _ in range(PROFILED_SYNCS):
                stats = sender.sync(state, version=next(version))
    res["bytes"] = stats.bytes_written  # steady state: parameters only (unchanged RoPE buffers skip)
    res["buffer_bytes"] = sender.buffers.nbytes
    keys = sender.ws.keys
    times = []
    for _ in range(args.warmup + args.repeats):
        synchronize(device.type)
        t = time.perf_counter()
        sender.ws.validate(state, [k for k in keys if state[k].requires_grad])
        synchronize(device.type)
        times.append(time.perf_counter() - t)
    res["times"]["ours: validation alone (overlapped with the first buckets above)"] = median(times[args.warmup:])

    # 3. A raw broadcast of the same bytes over the same group.
    flat = torch.randn(res["bytes"] // 2, device=device).to(torch.bfloat16)
    ch.put("raw_bytes", flat.numel() * 2)
    times = []
    for i in range(args.warmup + args.repeats):
        synchronize(device.type)
        t = time.perf_counter()
        ch.put(f"raw/h/{i}", i)
        broadcast(world.group, flat, root=0).wait()
        ch.get(f"raw/a/{i}")
        times.append(time.perf_counter() - t)
    res["times"][RAW] = median(times[args.warmup:])
    ch.put("wire/go", 1)
    for _ in range(2):  # warm-up
        broadcast(world.group, flat, root=0).wait()
    synchronize(device.type)
    ch.get("wire/ready")
    t = time.perf_counter()
    for _ in range(args.repeats):
        broadcast(world.group, flat, root=0).wait()
    synchronize(device.type)
    res["times"][WIRE] = (time.perf_counter() - t) / args.repeats
    ch.get("wire/done")
    del flat
    return res


def trainer_vllm(world, flavor: str, args, res: dict) -> None:
    """vLLM's NCCL engine, trainer side (rank 0 of its own StatelessProcessGroup)."""
    from bench_weight_sync import hf_weights  # noqa: E402

    ch = Channel(world, f"{flavor}/vllm")
    status = ch.get("status", timeout_s=600)
    if status != "ready":
        res["errors"]["vllm"] = status
        return
    try:
        sys.path.insert(0, str(RAY_STUB))
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine,
        )

        shape = resolve_shape(flavor=flavor, hf_checkpoint=None, vocab_size=0, max_seq_len=args.max_seq_len)
        model = build_titan_model(shape, seed=0, device=world.device)  # the trainer's init weights, HF names
        hf_state = hf_weights(model, shape)
    except Exception as e:
        ch.put("meta", {"error": f"{type(e).__name__}: {e}"[:500]})  # the generator skips too
        raise
    ch.put("meta", {"names": list(hf_state), "shapes": [list(v.shape) for v in hf_state.values()]})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ch.put("port", port)
    group = NCCLWeightTransferEngine.trainer_init({"master_address": "127.0.0.1", "master_port": port, "world_size": 2})
    send_args = NCCLTrainerSendWeightsArgs(group=group, packed=True, post_iter_func=lambda kv: kv[1].to(torch.bfloat16))
    times = []
    for i in range(args.vllm_warmup + args.vllm_repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        ch.put(f"go/{i}", i)
        NCCLWeightTransferEngine.trainer_send_weights(iter(hf_state.items()), send_args)
        answer = ch.get(f"done/{i}")
        times.append(time.perf_counter() - t)
        if answer != "ok":
            res["errors"]["vllm"] = answer
            return
    res["times"][VLLM] = median(times[args.vllm_warmup:])
    res["vllm_bytes"] = sum(v.numel() * 2 for v in hf_state.values())


# --------------------------------------------------------------------- generator


def generator_flavor(world, flavor: str, args, workdir: Path) -> dict:
    from torchtitan_rl.engine.engine import Engine

    ch = Channel(world, flavor)
    shape = resolve_shape(flavor=flavor, hf_checkpoint=None, vocab_size=16 if flavor == "tiny" else 0,
                          max_seq_len=args.max_seq_len)
    cuda = world.device.type == "cuda"
    t = time.perf_counter()
    with compat.vllm_device(world.device):
        gen = Engine(
            GeneratorConfig(max_model_len=args.max_seq_len, max_num_seqs=64, enforce_eager=True,
                            gpu_memory_utilization=0.15, wait_for_weights_s=60.0),
            model_config=ModelConfig(flavor=flavor, max_seq_len=args.max_seq_len), shape=shape, seed=0,
            device=world.device.type, workdir=workdir / flavor,
        )
    out = {"generator_build_s": time.perf_counter() - t}
    t = time.perf_counter()
    receiver = NcclReceiver(generator=gen, world=world, name=flavor)
    out["plan_s"] = time.perf_counter() - t
    out["generator_device"] = str(next(iter(gen.model.sync_targets().values())).view.device)

    g = torch.Generator().manual_seed(0)
    vocab = shape.vocab_size
    prompts = torch.randint(1, vocab, (args.prompts, 16), generator=g).tolist()
    sampling = SamplingConfig(temperature=1.0, max_tokens=args.max_tokens)
    receiver.receive()
    r1 = gen.generate(prompts, n=2, sampling=sampling, seed=1)
    ch.put("r1", r1.__dict__)
    receiver.receive()
    r2 = gen.generate(prompts, n=2, sampling=sampling, seed=1)
    ch.put("r2", r2.__dict__)
    ch.put("changed", r2.completion_ids != r1.completion_ids)

    g_times = {}
    for label, *_ in ours_configs(args):
        times = [receiver.receive().seconds for _ in range(args.warmup + args.repeats)]
        g_times[label] = median(times[args.warmup:])
    out["generator_side_s"] = g_times
    if args.profile:
        with profiled(Path(args.profile) / f"profile_generator_{flavor}.txt", world.device):
            for _ in range(PROFILED_SYNCS):
                receiver.receive()

    nbytes = ch.get("raw_bytes")
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=world.device)  # the sender's dtype and count
    for i in range(args.warmup + args.repeats):
        ch.get(f"raw/h/{i}")
        broadcast(world.group, flat, root=0).wait()
        synchronize(world.device.type)
        ch.put(f"raw/a/{i}", "ok")
    ch.get("wire/go")
    for _ in range(2):
        broadcast(world.group, flat, root=0).wait()
    synchronize(world.device.type)
    works = [broadcast(world.group, flat, root=0) for _ in range(args.repeats)]
    ch.put("wire/ready", 1)  # all receives posted before the trainer starts its clock
    for w in works:
        w.wait()
    synchronize(world.device.type)
    ch.put("wire/done", 1)
    del flat
    return out


def generator_vllm(world, flavor: str, args, workdir: Path) -> None:
    """vLLM's NCCL engine, worker side: vLLM's native Qwen3 in process, weight_transfer_config=nccl."""
    ch = Channel(world, f"{flavor}/vllm")
    try:
        sys.path.insert(0, str(RAY_STUB))
        from vllm import EngineArgs, LLMEngine
        from vllm.config import WeightTransferConfig

        shape = resolve_shape(flavor=flavor, hf_checkpoint=None, vocab_size=0, max_seq_len=args.max_seq_len)
        model_dir = workdir / f"native_{flavor}"
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(
            json.dumps(shape.to_hf_config())
        )
        with compat.vllm_device(world.device):
            engine = LLMEngine.from_engine_args(EngineArgs(
                model=str(model_dir), load_format="dummy", dtype="bfloat16", max_model_len=128, max_num_seqs=8,
                enforce_eager=True, seed=0, skip_tokenizer_init=True, gpu_memory_utilization=0.05,
                kv_cache_memory_bytes=256 << 20, disable_log_stats=True,
                weight_transfer_config=WeightTransferConfig(backend="nccl"),
            ))
    except Exception as e:  # noqa: BLE001  (reported in the table, the trainer skips this method)
        ch.put("status", f"{type(e).__name__}: {e}"[:500])
        return
    ch.put("status", "ready")
    meta = ch.get("meta")
    if "error" in meta:
        return
    port = ch.get("port")
    engine.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}})
    info = {"names": meta["names"], "dtype_names": ["bfloat16"] * len(meta["names"]), "shapes": meta["shapes"],
            "packed": True}
    for i in range(args.vllm_warmup + args.vllm_repeats):
        ch.get(f"go/{i}")
        try:
            engine.collective_rpc("start_weight_update")
            engine.collective_rpc("update_weights", kwargs={"update_info": info})
            engine.collective_rpc("finish_weight_update")
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            ch.put(f"done/{i}", f"{type(e).__name__}: {e}"[:500])
            return
        ch.put(f"done/{i}", "ok")


# ------------------------------------------------------------------------ report


def report(results: list[dict], args, device: str) -> None:
    rows = []
    for res in results:
        t = res["times"]
        raw, wire = t.get(RAW), t.get(WIRE)
        for name, s in t.items():
            nbytes = res.get("vllm_bytes") if name == VLLM else res.get("bytes")
            rows.append([
                res["flavor"], f"{res['n_params'] / 1e6:.0f} M", name, f"{s * 1e3:.2f}",
                f"{s / raw:.2f}x" if raw else "", f"{s / wire:.2f}x" if wire else "",
                f"{nbytes / s / 1e9:.0f}" if nbytes and "validation" not in name else "",
            ])
    body = table(["model", "params", "method", "median ms", "vs raw (handshake)", "vs wire", "GB/s"], rows)
    checks = []
    for res in results:
        if "v1" in res:
            checks.append([
                res["flavor"], res["v1"]["tokens"], f"{res['v1']['max']:.2e}", f"{res['v1']['mean']:.2e}",
                f"{res['v2']['max']:.2e}", f"{res['v2']['mean']:.2e}",
                f"{res['v2_rollouts_vs_v1_trainer']['mean']:.2f}", res["completions_changed"],
            ])
    body += "\nCorrectness on this layout (|generator - trainer| logprob over the sampled tokens):\n\n" + table(
        ["model", "tokens", "v1 max", "v1 mean", "v2 max", "v2 mean", "v2 rollouts vs v1 weights, mean",
         "completions changed"], checks)
    errors = [f"- {r['flavor']} {k}: `{v}`" for r in results for k, v in r.get("errors", {}).items()]
    if errors:
        body += "\nFailed:\n" + "\n".join(errors) + "\n"
    body += (
        f"\nLayout: torchrun, 2 processes; rank 0 = the trainer (Trainer, FSDP2 over a one-rank default group, "
        f"fp32 masters) on GPU 0, rank 1 = the generator (torchtitan's Qwen3 in vLLM, in process, eager) on GPU 1; "
        f"random weights; median of {args.repeats} after {args.warmup} warm-up (vLLM engine: "
        f"{args.vllm_repeats} after {args.vllm_warmup}). Times are end to end on the trainer: from the sync call "
        "until the generator's answer arrived (it has published the version). Bytes = the steady-state wire "
        "bytes of ours (bf16 parameters; the unchanged fp32 RoPE buffers move on the first sync only). Ours = "
        "names/shapes check + header through the store + flat bf16 buckets, two send and two receive buffers "
        "(cast in the pack copy, one _foreach_copy_ unpack into the plan's views), with the NaN/inf scan of "
        "every fp32 master on a side stream and its verdict after the first two buckets (the generator unpacks "
        "nothing before it) + float64 checksums of the sampled tensors + the generator's answer through the "
        "store. 'vs raw (handshake)' = against one broadcast of the same bytes with the same store header and "
        "answer; 'vs wire' = against back-to-back broadcasts with no handshake.\n"
    )
    write_section(args.section, device=device, body=body, path=Path(args.md))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavors", nargs="+", default=["0.6B", "1.7B"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--buckets", nargs="+", type=int, default=[512, 128, 64], help="bucket MiB; first = default")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--vllm-repeats", type=int, default=5)
    parser.add_argument("--vllm-warmup", type=int, default=1)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM's NCCL engine")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="profile 3 default syncs on both sides; top-op tables to DIR/profile_*.txt")
    parser.add_argument("--scan-variants", action="store_true",
                        help="also time the NaN/inf scan on the current stream and before sending (host sync)")
    parser.add_argument("--startup-timeout", type=float, default=180.0,
                        help="seconds the trainer waits for the generator's plan (engine start included)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--md", default=str(BENCHMARKS_MD), help="where the table goes")
    parser.add_argument("--section", default="Weight sync over NCCL, generator on its own GPU (cuda, nvidia-h200-x2)")
    args = parser.parse_args()

    world = init_world(args.device)
    workdir = Path(tempfile.mkdtemp(prefix="bench_nccl_"))
    results = []
    for flavor in args.flavors:
        if world.role == "trainer":
            res = trainer_flavor(world, flavor, args, workdir)
            res["generator"] = Channel(world, flavor).get("generator_out")
            results.append(res)
            print(json.dumps(res, indent=1), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
            report(results, args, args.device)
        else:
            out = generator_flavor(world, flavor, args, workdir)
            Channel(world, flavor).put("generator_out", out)
    if args.device == "cuda" and not args.no_vllm:
        for flavor in args.flavors:
            if world.role == "trainer":
                res = next(r for r in results if r["flavor"] == flavor)
                try:
                    trainer_vllm(world, flavor, args, res)
                except Exception as e:  # noqa: BLE001  (keep the other numbers)
                    res["errors"]["vllm"] = f"{type(e).__name__}: {e}"[:500]
                print(json.dumps(res["times"], indent=1), res["errors"], flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=1))
                report(results, args, args.device)
            else:
                generator_vllm(world, flavor, args, workdir)
    if world.role == "trainer":
        Channel(world, "end").put("done", 1)
    else:
        Channel(world, "end").get("done")
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's in-process engine teardown


if __name__ == "__main__":
    main()
