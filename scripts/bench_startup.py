"""Engine startup: dummy load + first sync vs a full load_format="auto" start.

Each start runs in a fresh process with the generator settings of the run
config (CUDA graphs included). dummy: Engine(load_format="dummy") with the
trainer's weights already on the GPU, the sync plan, the first sync. auto:
Engine(load_format="auto") from a local HF checkpoint (safetensors, bf16)
that the dummy process wrote from the same weights, so both must sample the
same completions. native: vLLM's own Qwen3ForCausalLM from that checkpoint,
for reference. "ready" ends when the first short generate() returns.

    python scripts/bench_startup.py --config run_configs/qwen3_0.6b.toml
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_PROCESS = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import table, write_section  # noqa: E402

PROMPTS = [[1, 4, 5, 6, 14], [1, 7, 7, 2, 14], [1, 13, 4, 9, 14], [1, 5, 5, 5, 14]]


def worker(kind: str, config: str, ckpt: Path, device: str) -> dict:
    import torch

    from torchtitan_rl.config import ModelConfig, SamplingConfig, WeightSyncConfig, parse_args
    from torchtitan_rl.engine.engine import Engine, build_engine
    from torchtitan_rl.models.families import resolve_shape, to_hf
    from torchtitan_rl.models.shape import build_titan_model

    workdir = Path(tempfile.mkdtemp(prefix="startup_"))
    cfg = parse_args(["--config", config, "--job.output_dir", str(workdir)])
    from torchtitan_rl.grpo import build_task

    vocab = cfg.model.vocab_size or (build_task(cfg.grpo.task).vocab_size if cfg.model.flavor == "tiny" else 0)
    shape = resolve_shape(flavor=cfg.model.flavor, hf_checkpoint=None, vocab_size=vocab,
                          max_seq_len=cfg.model.max_seq_len)
    res = {"import_s": time.perf_counter() - T_PROCESS}
    sampling = SamplingConfig(temperature=1.0, max_tokens=16)
    if kind == "dummy":
        from safetensors.torch import save_file

        from torchtitan_rl.weight_sync.sync import WeightSync

        titan = build_titan_model(shape, seed=cfg.job.seed, device=device)  # the trainer's, not timed
        state = {**dict(titan.named_parameters()), **dict(titan.named_buffers())}
        t0 = time.perf_counter()
        gen = Engine(cfg.generator, model_config=cfg.model, shape=shape, seed=0, device=device, workdir=workdir)
        t1 = time.perf_counter()
        ws = WeightSync(cfg.weight_sync, reference=state, generator=gen)
        t2 = time.perf_counter()
        ws.sync(state, version=1)
        t3 = time.perf_counter()
        ids = gen.generate(PROMPTS, n=1, sampling=sampling, seed=0).completion_ids
        t4 = time.perf_counter()
        res.update(engine_build_s=t1 - t0, plan_s=t2 - t1, first_sync_s=t3 - t2, first_generate_s=t4 - t3,
                   ready_s=t4 - t0, completions=ids)
        # The HF checkpoint the auto starts load: the same weights, bf16 safetensors.
        t = time.perf_counter()
        ckpt.mkdir(parents=True, exist_ok=True)
        hf_state = to_hf(titan.state_dict(), shape)
        save_file({k: v.contiguous().bfloat16().cpu() for k, v in hf_state.items()}, ckpt / "model.safetensors")
        (ckpt / "config.json").write_text(
            json.dumps(shape.to_hf_config())
        )
        res["checkpoint_write_s"] = time.perf_counter() - t
        res["checkpoint_bytes"] = (ckpt / "model.safetensors").stat().st_size
        return res
    t0 = time.perf_counter()
    if kind == "auto":
        config = cfg.generator
        config.load_format = "auto"
        gen = Engine(config, model_config=ModelConfig(**{**vars(cfg.model), "hf_checkpoint": str(ckpt)}),
                     shape=shape, seed=0, device=device, workdir=workdir)
        t1 = time.perf_counter()
        ids = gen.generate(PROMPTS, n=1, sampling=sampling, seed=0).completion_ids
    else:  # vLLM's native Qwen3 from the same checkpoint
        from vllm import SamplingParams

        g = cfg.generator
        engine = build_engine(
            model=str(ckpt), load_format="auto", dtype="bfloat16", max_model_len=g.max_model_len,
            max_num_seqs=g.max_num_seqs, enforce_eager=g.enforce_eager, tensor_parallel_size=1, seed=0,
            device=device, gpu_memory_utilization=g.gpu_memory_utilization,
            kv_cache_memory_bytes=int(g.kv_cache_memory_gb * (1 << 30)),
            batch_invariant=False,
        )
        t1 = time.perf_counter()
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=16, seed=i))
        ids = []
        while engine.has_unfinished_requests():
            ids += [list(o.outputs[0].token_ids) for o in engine.step() if o.finished]
    t2 = time.perf_counter()
    res.update(engine_build_s=t1 - t0, first_generate_s=t2 - t1, ready_s=t2 - t0, completions=ids)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="run_configs/qwen3_0.6b.toml")
    parser.add_argument("--starts", nargs="+", default=["dummy", "auto", "native"],
                        choices=["dummy", "auto", "native"])
    parser.add_argument("--json", default=None, help="also write the raw results here")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        res = worker(args.worker, args.config, Path(args.ckpt), args.device)
        Path(args.worker_out).write_text(json.dumps(res))
        print(json.dumps(res), flush=True)
        os._exit(0)  # skip vLLM's in-process engine teardown

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "hf_checkpoint"
        for kind in ["dummy"] + [k for k in args.starts if k != "dummy"]:
            out = Path(tmp) / f"{kind}.json"
            cmd = [sys.executable, __file__, "--config", args.config, "--worker", kind, "--ckpt", str(ckpt),
                   "--worker-out", str(out), "--device", args.device]
            t = time.perf_counter()
            proc = subprocess.run(cmd)
            wall = time.perf_counter() - t
            print(f"[bench_startup] {kind}: exit {proc.returncode} in {wall:.0f} s", flush=True)
            if proc.returncode == 0:
                results[kind] = {**json.loads(out.read_text()), "process_wall_s": wall}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))

    d = results.get("dummy", {})
    rows = []
    for kind, label in (("dummy", "ours: dummy load + plan + first sync"), ("auto", "ours: load_format=auto"),
                        ("native", "vLLM native Qwen3: load_format=auto")):
        r = results.get(kind)
        if r is None:
            rows.append([label, "failed" if kind in args.starts or kind == "dummy" else "not run", "", "", "", ""])
            continue
        extra = (f"plan {r['plan_s'] * 1e3:.0f} ms + first sync {r['first_sync_s'] * 1e3:.1f} ms"
                 if kind == "dummy" else "weights read from the checkpoint inside the build")
        rows.append([label, f"{r['ready_s']:.1f}", f"{r['engine_build_s']:.1f}", extra,
                     f"{r['import_s']:.1f}", f"{r['process_wall_s']:.0f}"])
    same = results.get("auto", {}).get("completions") == d.get("completions") if "auto" in results else None
    body = (
        f"`{args.config}` generator settings (CUDA graphs as configured), one fresh process per start. "
        f"ready = from the Engine/engine constructor to the end of the first generate() (4 prompts x 16 "
        f"tokens); import = Python + vLLM/torchtitan imports before it; process = whole subprocess wall "
        f"incl. the dummy start writing the checkpoint. Checkpoint: {d.get('checkpoint_bytes', 0) / 2**30:.2f} "
        f"GiB bf16 safetensors on local disk, written in {d.get('checkpoint_write_s', 0):.1f} s just before "
        f"the auto starts (hot page cache: the best case for auto).\n\n"
        + table(["start", "ready s", "engine build s", "of which / then", "import s", "process s"], rows)
        + f"\nSame completions (seeded) from the auto-loaded and the synced generator: {same}.\n"
    )
    write_section(f"Engine startup ({args.device})", device=args.device, body=body)


if __name__ == "__main__":
    main()
