"""Weight sync: ours vs vLLM's reload_weights / IPC engine vs a plain copy of the same bytes.

Same model shape, median of several runs. The source is the trainer's fp32
master weights; the generator holds bf16, so the floor is a cast-copy of the
same number of elements (read 4 bytes, write 2 per parameter). vLLM's
reload_weights runs on vLLM's native Qwen3 (its intended use), in process.

On CUDA each model shape runs in its own process (in-process vLLM engines do
not give their GPU memory back), and two more baselines join:
- vLLM's IPC weight-transfer engine (vllm.distributed.weight_transfer), with
  the engine core in a child process as vLLM runs it: CUDA IPC handles cannot
  be opened by the process that made them, so it cannot run in one process.
  The handles travel pickled through collective_rpc, the payload of vLLM's
  HTTP route without the HTTP server.
- peak extra GPU memory of ours (torch.cuda.max_memory_allocated delta).

Mixture-of-experts shapes (Qwen3 MoE): ``--layers N`` keeps the first N decoder layers of a shape whose fp32
masters do not fit one GPU (every tensor keeps its 30B-A3B shape; the table names the layers and the whole
model's size), and ``--bucket-mb`` adds a row of ours per bucket size (weight_sync.bucket_mb: the tensors
cast, copied and verified together).

    python scripts/bench_weight_sync.py --flavors tiny debugmodel 0.6B
    python scripts/bench_weight_sync.py --device cuda --flavors 0.6B 1.7B 4B 8B
    python scripts/bench_weight_sync.py --device cuda --flavors debugmodel_moe 30B-A3B --layers 8 \
        --bucket-mb 128 512 2048 --section "Weight sync, MoE (cuda)"
"""

import argparse
import base64
import dataclasses
import gc
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import median_seconds, synchronize, table, write_section  # noqa: E402

from torchtitan_rl.config import GeneratorConfig, ModelConfig, WeightSyncConfig  # noqa: E402
from torchtitan_rl.engine.engine import Engine, build_engine  # noqa: E402
from torchtitan_rl.models.families import resolve_shape, to_hf  # noqa: E402
from torchtitan_rl.models.moe import synced, synced_state  # noqa: E402
from torchtitan_rl.models.shape import build_titan_model, titan_config  # noqa: E402
from torchtitan_rl.weight_sync.sync import WeightSync  # noqa: E402

RAY_STUB = Path(__file__).resolve().parent / "gpu" / "stubs"
"""vLLM 0.26's IPC engine imports ray at module level; the GPU image has none."""
FLOOR = "floor: fp32->bf16 cast copy"
SAME_BYTES = "floor: same bytes as ours (params cast + fp32 buffers copied)"
PROTOTYPE = "ours (sampled), prototype: unchanged RoPE buffers skipped after the first sync"
GiB = 1 << 30
DEFAULT_BUCKET_MB = WeightSyncConfig().bucket_mb


def bench_shape(flavor: str, *, layers: int | None):
    """The flavor's shape (vocabulary 16 for the tiny ones), cut to its first ``layers`` decoder layers when it
    has more; and the label the table shows for it."""
    shape = resolve_shape(flavor=flavor, hf_checkpoint=None, vocab_size=16 if flavor.startswith("tiny") else 0,
                          max_seq_len=128)
    if layers is None or layers >= shape.num_hidden_layers:
        return shape, flavor
    label = f"{flavor} ({layers} of {shape.num_hidden_layers} layers)"
    return dataclasses.replace(shape, num_hidden_layers=layers), label


def param_count(shape) -> tuple[int, int]:
    """Parameters and buffer elements of the shape's model (built on the meta device)."""
    with torch.device("meta"):
        meta = titan_config(shape).build()
    return (sum(p.numel() for p in meta.parameters()),
            sum(b.numel() for name, b in meta.named_buffers() if synced(name)))


def bucket_rows(ws_for, state: dict, *, buckets: list[int], device: str, repeats: int, times: dict,
                peaks: dict | None = None) -> None:
    """ours (verify=sampled) at each bucket size other than the default (whose row is already there)."""
    version = iter(range(100_000, 200_000))
    for mb in buckets:
        if mb == DEFAULT_BUCKET_MB:
            continue
        ws = ws_for(WeightSyncConfig(verify="sampled", bucket_mb=mb))
        name = f"ours (verify=sampled, bucket {mb} MiB)"
        times[name] = median_seconds(lambda: ws.sync(state, version=next(version)), device=device, repeats=repeats)
        if peaks is not None:
            peaks[name] = _peak_extra(lambda: ws.sync(state, version=next(version)))


def native_engine(shape, workdir: Path, device: str):
    """vLLM's own Qwen3 (fused qkv_proj/gate_up_proj), dummy weights."""
    model_dir = workdir / "native"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(
        json.dumps(shape.to_hf_config())
    )
    return build_engine(
        model=str(model_dir), load_format="dummy", dtype="bfloat16", max_model_len=128,
        max_num_seqs=8, enforce_eager=True, tensor_parallel_size=1, seed=0, device=device,
        gpu_memory_utilization=0.2, kv_cache_memory_bytes=64 << 20, batch_invariant=False,
    )


def hf_weights(trainer, shape) -> dict[str, torch.Tensor]:
    """The trainer's weights in HF names and layout (what vLLM's native Qwen3 loads)."""
    hf_state = to_hf(trainer.state_dict(), shape)
    return {k: v.detach().contiguous() for k, v in hf_state.items()}


def bench_flavor(flavor: str, *, device: str, repeats: int, workdir: Path, layers: int | None = None,
                 buckets: list[int] = (DEFAULT_BUCKET_MB,)) -> list:
    shape, label = bench_shape(flavor, layers=layers)
    trainer = build_titan_model(shape, seed=0, device=device)
    state = synced_state(trainer)  # parameters and buffers, an MoE's expert counters left out
    n_params = sum(p.numel() for p in trainer.parameters())

    gen = Engine(
        GeneratorConfig(max_model_len=128, max_num_seqs=8, gpu_memory_utilization=0.2),
        model_config=ModelConfig(flavor=flavor), shape=shape, seed=0, device=device, workdir=workdir,
    )
    rows = {}
    for verify in ("off", "sampled", "full"):
        ws = WeightSync(WeightSyncConfig(verify=verify), reference=state, generator=gen)
        version = iter(range(1, 10_000))
        rows[f"ours (verify={verify})"] = median_seconds(
            lambda: ws.sync(state, version=next(version)), device=device, repeats=repeats
        )
    moved = ws.plan.nbytes
    bucket_rows(lambda config: WeightSync(config, reference=state, generator=gen), state, buckets=list(buckets),
                device=device, repeats=repeats, times=rows)

    # Floors: one flat buffer of the same element count.
    src32 = torch.randn(n_params, device=device)
    dst16 = torch.empty(n_params, device=device, dtype=torch.bfloat16)
    src16 = src32.bfloat16()
    rows[FLOOR] = median_seconds(lambda: dst16.copy_(src32), device=device, repeats=repeats)
    rows["floor: bf16 copy"] = median_seconds(lambda: dst16.copy_(src16), device=device, repeats=repeats)
    del src32, src16, dst16

    # vLLM's reload_weights on its native Qwen3, fed the same weights in HF names.
    del gen
    engine = native_engine(shape, workdir, device)
    hf_state = hf_weights(trainer, shape)

    def reload():
        engine.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(hf_state.items()), "is_checkpoint_format": True}
        )

    rows["vLLM reload_weights (native Qwen3)"] = median_seconds(reload, device=device, repeats=repeats)
    del engine

    floor = rows[FLOOR]
    return [
        [label, f"{n_params / 1e6:.1f} M", name, f"{t * 1e3:.2f}", f"{t / floor:.2f}x"]
        for name, t in rows.items()
    ] + [[label, "", f"bytes written by ours: {moved / 2**20:.1f} MiB", "", ""]]


# ----------------------------------------------------------------------------- CUDA


def _util(nbytes: int, headroom_gib: float) -> float:
    """gpu_memory_utilization that fits bf16 weights of ``nbytes`` plus headroom (KV, activations)."""
    total = torch.cuda.mem_get_info()[1]
    return round((nbytes + headroom_gib * GiB) / total + 0.005, 3)


def _native_dir(shape, workdir: Path) -> Path:
    model_dir = workdir / "native"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(
        json.dumps(shape.to_hf_config())
    )
    return model_dir


def _native_engine_cuda(shape, workdir: Path, *, ipc: bool):
    """vLLM's native Qwen3, dummy weights, a small KV cache; IPC engine core in a child process."""
    from vllm import EngineArgs, LLMEngine

    kwargs = {}
    if ipc:
        from vllm.config import WeightTransferConfig

        kwargs["weight_transfer_config"] = WeightTransferConfig(backend="ipc")
    args = EngineArgs(
        model=str(_native_dir(shape, workdir)), load_format="dummy", dtype="bfloat16",
        max_model_len=128, max_num_seqs=8, enforce_eager=True, seed=0, skip_tokenizer_init=True,
        gpu_memory_utilization=0.05,  # only vLLM's free-memory check reads it; the KV size is explicit
        kv_cache_memory_bytes=256 << 20, disable_log_stats=True, **kwargs,
    )
    return LLMEngine.from_engine_args(args)


def _peak_extra(fn) -> int:
    """Bytes allocated on top of what was live when ``fn`` started."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bench_ipc(hf_state: dict, shape, workdir: Path, repeats: int) -> dict:
    """vLLM's IPC weight-transfer engine: start_weight_update -> trainer_send_weights -> finish."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the engine core must be another process
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # to unpickle the handles, as the HTTP route
    os.environ["PYTHONPATH"] = f"{RAY_STUB}:{os.environ.get('PYTHONPATH', '')}"
    sys.path.insert(0, str(RAY_STUB))
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    t = time.perf_counter()
    engine = _native_engine_cuda(shape, workdir, ipc=True)
    out = {"ipc_engine_build_s": time.perf_counter() - t}
    engine.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {}})

    def send(info) -> None:
        update = {
            "names": info.names, "dtype_names": info.dtype_names, "shapes": info.shapes,
            "packed": info.packed,
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(info.ipc_handles)).decode(),
        }
        if info.tensor_sizes is not None:
            update["tensor_sizes"] = info.tensor_sizes
        engine.collective_rpc("update_weights", kwargs={"update_info": update})

    largest_bf16 = max(v.numel() for v in hf_state.values()) * 2
    buffer = max(1 << 30, 1 << (largest_bf16 - 1).bit_length())

    def round_trip(packed: bool) -> None:
        engine.collective_rpc("start_weight_update")
        if packed:  # cast on the trainer side, as trainers do to halve the bytes
            items = ((k, v.to(torch.bfloat16)) for k, v in hf_state.items())
        else:
            items = iter(hf_state.items())
        IPCWeightTransferEngine.trainer_send_weights(
            items, {"send_mode": send, "packed": packed, "packed_buffer_size_bytes": buffer}
        )
        engine.collective_rpc("finish_weight_update")

    try:
        out["vLLM IPC engine, one call, fp32 source"] = median_seconds(
            lambda: round_trip(False), device="cuda", repeats=repeats, warmup=1
        )
        out[f"vLLM IPC engine, packed {buffer >> 20} MiB buffer, bf16 cast by trainer"] = median_seconds(
            lambda: round_trip(True), device="cuda", repeats=repeats, warmup=1
        )
    finally:
        engine.engine_core.shutdown()
        del engine
        gc.collect()
        time.sleep(2)  # let the child process exit and its memory go
    return out


def bench_ours(res: dict, trainer, state: dict, shape, workdir: Path, repeats: int, buckets: list[int]) -> None:
    """Our sync into the generator in this process: three verification levels, peaks, validation alone."""
    times, n_params, n_buffers, flavor = res["times"], res["n_params"], res["n_buffers"], res["flavor"]
    t = time.perf_counter()
    gen = Engine(
        GeneratorConfig(
            max_model_len=128, max_num_seqs=8, enforce_eager=True,
            gpu_memory_utilization=_util(2 * n_params + 4 * n_buffers, 3.0),
        ),
        model_config=ModelConfig(), shape=shape, seed=0, device="cuda", workdir=workdir,
    )
    res["ours_generator_build_s"] = time.perf_counter() - t
    version = iter(range(1, 100_000))
    peaks = {}
    for verify in ("off", "sampled", "full"):
        ws = WeightSync(WeightSyncConfig(verify=verify), reference=state, generator=gen)
        name = f"ours (verify={verify})"
        times[name] = median_seconds(lambda: ws.sync(state, version=next(version)), device="cuda", repeats=repeats)
        peaks[name] = _peak_extra(lambda: ws.sync(state, version=next(version)))
    times["ours: validation alone (names, shapes, NaN/inf scan)"] = median_seconds(
        lambda: ws.validate(state), device="cuda", repeats=repeats
    )
    bucket_rows(lambda config: WeightSync(config, reference=state, generator=gen), state, buckets=buckets,
                device="cuda", repeats=repeats, times=times, peaks=peaks)
    res["peak_extra_bytes"] = peaks
    res["bytes_written"] = ws.plan.nbytes

    # Prototype of a proposed change (monkeypatched here, not in weight_sync/): the RoPE buffers
    # never change, so after the first sync copy and scan only the parameters.
    buffer_keys = {k for k, _ in trainer.named_buffers()}
    ws = WeightSync(WeightSyncConfig(verify="sampled"), reference=state, generator=gen)
    ws.sync(state, version=next(version))
    ws.keys = [k for k in ws.keys if k not in buffer_keys]  # buckets are cut from keys per sync
    times[PROTOTYPE] = median_seconds(lambda: ws.sync(state, version=next(version)), device="cuda", repeats=repeats)
    res["peak_extra_bytes"][PROTOTYPE] = _peak_extra(lambda: ws.sync(state, version=next(version)))


def bench_flavor_cuda(flavor: str, *, repeats: int, workdir: Path, methods: list[str], layers: int | None = None,
                      buckets: list[int] = (DEFAULT_BUCKET_MB,)) -> dict:
    """One shape, every method; run in a fresh process (see the module docstring)."""
    shape, label = bench_shape(flavor, layers=layers)
    n_params, n_buffers = param_count(shape)  # buffers: fp32 RoPE caches, synced too
    if n_params > 3e9:
        repeats = min(repeats, 5)
    res: dict = {"flavor": label, "n_params": n_params, "n_buffers": n_buffers, "times": {}, "methods": methods}
    if label != flavor:  # what the whole model would move: the sync scales with its bytes
        res["whole_model_params"] = param_count(resolve_shape(flavor=flavor, hf_checkpoint=None, vocab_size=0,
                                                              max_seq_len=128))[0]
    times = res["times"]

    # 1. Floors first, on flat buffers of the same element count, freed before anything else.
    src32 = torch.randn(n_params, device="cuda")
    dst16 = torch.empty(n_params, device="cuda", dtype=torch.bfloat16)
    times[FLOOR] = median_seconds(lambda: dst16.copy_(src32), device="cuda", repeats=repeats)
    del src32
    src16 = torch.randn(n_params, device="cuda", dtype=torch.bfloat16)
    times["floor: bf16 copy"] = median_seconds(lambda: dst16.copy_(src16), device="cuda", repeats=repeats)
    del src16, dst16
    # The same bytes as ours: the parameters cast, plus the fp32 buffers copied.
    src32 = torch.randn(n_params, device="cuda")
    dst16 = torch.empty(n_params, device="cuda", dtype=torch.bfloat16)
    buf_src, buf_dst = torch.randn(n_buffers, device="cuda"), torch.empty(n_buffers, device="cuda")
    times[SAME_BYTES] = median_seconds(
        lambda: (dst16.copy_(src32), buf_dst.copy_(buf_src)), device="cuda", repeats=repeats
    )
    del src32, dst16, buf_src, buf_dst
    torch.cuda.empty_cache()

    # 2. The trainer's fp32 master weights (+ RoPE buffers).
    trainer = build_titan_model(shape, seed=0, device="cuda")
    state = synced_state(trainer)  # parameters and buffers, an MoE's expert counters left out

    # 3. vLLM's IPC engine (child process; gone before the in-process engines start).
    res["errors"] = {}
    if "ipc" in methods:
        try:
            hf_state = hf_weights(trainer, shape)
            res.update(bench_ipc(hf_state, shape, workdir, repeats))
            for k in [k for k in res if k.startswith("vLLM IPC")]:
                times[k] = res.pop(k)
        except Exception as e:  # keep the other methods' numbers
            res["errors"]["ipc"] = f"{type(e).__name__}: {e}"[:500]
            print(f"[bench_weight_sync] IPC engine failed: {res['errors']['ipc']}", flush=True)
        hf_state = None
        gc.collect()
        torch.cuda.empty_cache()

    # 4. Ours: the generator in this process, all three verification levels.
    if "ours" in methods:
        bench_ours(res, trainer, state, shape, workdir, repeats, list(buckets))

    # 5. vLLM's reload_weights on its native Qwen3, in process, fed the same weights in HF names.
    if "reload" in methods:
        try:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            engine = _native_engine_cuda(shape, workdir, ipc=False)
            hf_state = hf_weights(trainer, shape)

            def reload():
                engine.collective_rpc(
                    "reload_weights",
                    kwargs={"weights_iterator": iter(hf_state.items()), "is_checkpoint_format": True},
                )

            times["vLLM reload_weights (native Qwen3)"] = median_seconds(
                reload, device="cuda", repeats=repeats, warmup=1
            )
        except Exception as e:
            res["errors"]["reload"] = f"{type(e).__name__}: {e}"[:500]
            print(f"[bench_weight_sync] reload_weights failed: {res['errors']['reload']}", flush=True)
    return res


def _worker(flavor: str, methods: list[str], args, tmp: Path) -> dict | None:
    out = tmp / f"{flavor}_{'_'.join(methods)}.json"
    cmd = [sys.executable, __file__, "--device", "cuda", "--worker", flavor, "--json", str(out),
           "--repeats", str(args.repeats), "--methods", *methods, "--bucket-mb", *map(str, args.bucket_mb)]
    if args.layers is not None:
        cmd += ["--layers", str(args.layers)]
    t = time.perf_counter()
    proc = subprocess.run(cmd)
    print(f"[bench_weight_sync] {flavor} {methods}: exit {proc.returncode} in {time.perf_counter() - t:.0f} s",
          flush=True)
    return json.loads(out.read_text()) if proc.returncode == 0 else None


def _merge(old: dict, new: dict) -> dict:
    """New times and peaks win; errors of methods that now ran are dropped."""
    merged = {**old, **{k: v for k, v in new.items() if k not in ("times", "errors", "peak_extra_bytes")}}
    merged["times"] = {**old.get("times", {}), **new.get("times", {})}
    merged["peak_extra_bytes"] = {**old.get("peak_extra_bytes", {}), **new.get("peak_extra_bytes", {})}
    ran = set(new.get("methods", []))
    merged["errors"] = {**{k: v for k, v in old.get("errors", {}).items() if k not in ran}, **new.get("errors", {})}
    merged["methods"] = sorted(set(old.get("methods", [])) | ran)
    return merged


def run_cuda(args) -> None:
    previous = {r["flavor"]: r for r in json.loads(Path(args.merge_json).read_text())} if args.merge_json else {}
    results, missing = dict(previous), []
    with tempfile.TemporaryDirectory() as tmp:
        for flavor in args.flavors:
            # reload_weights gets its own process: with ours' generator still resident an 8B
            # shape does not fit next to it on an 80 GB GPU (in-process engines keep their memory).
            groups = [[m for m in args.methods if m != "reload"], ["reload"] if "reload" in args.methods else []]
            for methods in filter(None, groups):
                res = _worker(flavor, methods, args, Path(tmp))
                if res is None:
                    missing.append(flavor)
                else:  # keyed by the table's label: a shape cut to fewer layers is another row
                    results[res["flavor"]] = _merge(results.get(res["flavor"], {}), res)
    results = [results[f] for f in sorted(results, key=lambda f: results[f]["n_params"])]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    rows = []
    for res in results:
        times, floor = res["times"], res["times"][FLOOR]
        ours = times.get("ours (verify=sampled)")
        for name, t in times.items():
            peak = res.get("peak_extra_bytes", {}).get(name)
            rows.append([
                res["flavor"], f"{res['n_params'] / 1e6:.0f} M + {res['n_buffers'] / 1e6:.0f} M buf", name,
                f"{t * 1e3:.2f}", f"{t / floor:.2f}x", f"{t / ours:.2f}x" if ours else "",
                "" if peak is None else f"{peak / 2**20:.1f}",
            ])
    body = table(
        ["model", "params", "method", "median ms", "vs cast floor", "vs ours (sampled)", "peak extra MiB"], rows
    )
    errors = [f"- {r['flavor']} {k}: `{v}`" for r in results for k, v in r.get("errors", {}).items()]
    cut = [f"{r['flavor']}: {r['n_params'] / r['whole_model_params']:.1%} of the whole model's "
           f"{r['whole_model_params'] / 1e9:.1f} B parameters; its sync moves "
           f"~{r['whole_model_params'] / r['n_params']:.1f}x these bytes" for r in results if "whole_model_params" in r]
    if cut:
        body += "\nShapes cut to their first layers (--layers): " + "; ".join(cut) + ".\n"
    if previous:
        body += (f"\nMerged: this run ({' '.join(args.flavors)}: {' '.join(args.methods)}) over the "
                 f"earlier results in `{args.merge_json}`.\n")
    if errors or missing:
        body += "\nFailed: " + ", ".join(f"{f} (whole process)" for f in missing) + "\n" + "\n".join(errors) + "\n"
    body += (
        "\nSource: fp32 trainer master weights (+ RoPE buffers) on the GPU; destination: the generator's bf16 "
        "tensors. 'ours' = WeightSync.sync into torchtitan's Qwen3 inside vLLM (in-process), including "
        "validation (names, shapes, one fused NaN/inf scan that reads every fp32 byte once) and publishing; "
        "'verify' compares 0 / 4 / all tensors bit for bit after the copy. Peak extra = "
        "torch.cuda.max_memory_allocated() during one sync minus the memory allocated before it. "
        "vLLM baselines run its native Qwen3ForCausalLM (fused qkv/gate_up, layerwise reload) fed the same "
        "weights in HF names, prepared (to_hf, contiguous) outside the timed region. reload_weights: "
        "in process via collective_rpc. IPC engine: vllm.distributed.weight_transfer IPC backend, "
        "start_weight_update + IPCWeightTransferEngine.trainer_send_weights + finish_weight_update, engine "
        "core in a child process (CUDA IPC handles cannot be opened by the process that exported them), "
        "handles pickled through collective_rpc as vLLM's HTTP route does. Floors: one flat copy of the same "
        "element count; the 'same bytes' floor adds a flat fp32 copy of the buffers' element count (the "
        "RoPE cos/sin caches: max_position_embeddings x 2*head_dim fp32 per layer, which ours syncs too).\n"
    )
    write_section(args.section or "Weight sync (cuda)", device="cuda", body=body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavors", nargs="+", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--section", default=None, help="section name in docs/benchmarks.md")
    parser.add_argument("--methods", nargs="+", default=["ipc", "ours", "reload"], choices=["ipc", "ours", "reload"],
                        help="CUDA: what to run besides the floors")
    parser.add_argument("--merge-json", default=None,
                        help="CUDA: an earlier --json; this run's numbers replace or add to it")
    parser.add_argument("--json", default=None, help="CUDA: also write the raw results here")
    parser.add_argument("--layers", type=int, default=None,
                        help="keep the first N decoder layers of a deeper shape (30B-A3B's tensors on one GPU)")
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[DEFAULT_BUCKET_MB],
                        help="weight_sync.bucket_mb values: a row of ours (verify=sampled) per value")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        with tempfile.TemporaryDirectory() as tmp:
            res = bench_flavor_cuda(args.worker, repeats=args.repeats, workdir=Path(tmp), methods=args.methods,
                                    layers=args.layers, buckets=args.bucket_mb)
        Path(args.json).write_text(json.dumps(res))
        print(json.dumps(res, indent=1), flush=True)
        os._exit(0)  # skip vLLM's in-process engine teardown
    if args.device.startswith("cuda"):
        args.flavors = args.flavors or ["0.6B", "1.7B", "4B", "8B"]
        run_cuda(args)
        return
    args.flavors = args.flavors or ["tiny", "debugmodel"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for flavor in args.flavors:
            rows += bench_flavor(flavor, device=args.device, repeats=args.repeats, workdir=Path(tmp) / flavor,
                                 layers=args.layers, buckets=args.bucket_mb)
    body = table(["model", "params", "method", "median ms", "vs cast floor"], rows)
    body += (
        "\nSource: fp32 trainer master weights (+ RoPE buffers); destination: the generator's bf16 "
        "tensors, in place. 'ours' includes validation (names, shapes, NaN/inf scan) before writing.\n"
    )
    write_section(args.section or f"Weight sync ({args.device})", device=args.device, body=body)


if __name__ == "__main__":
    main()
