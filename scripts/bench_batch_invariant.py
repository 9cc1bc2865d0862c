"""Cost of batch-invariant mode: generator tokens/s and trainer step time vs default.

Same config, default mode first. On CPU both modes run single-threaded
(batch-invariant mode needs it; default mode gets the same for a fair
ratio). On CUDA each mode runs in its own process (vLLM engines keep their
GPU memory; the batch-invariant overrides are process-wide); both modes
run the generator as the config says (CUDA graphs unless enforce_eager).
--profile prints torch.profiler's top ops (CUDA: kernels) of one more
generate and train step per mode.

    python scripts/bench_batch_invariant.py --config run_configs/cpu_tiny.toml
"""

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def measure(cfg, *, repeats: int, out_dir: Path, profile: bool = False) -> dict:
    import statistics

    import torch

    from torchtitan_rl.engine.engine import Engine
    from torchtitan_rl.grpo import group_advantages
    from torchtitan_rl.grpo.batch import pack_rollouts
    from torchtitan_rl.run.parts import run_device, run_shape, run_task
    from torchtitan_rl.trainer import TrainBatch, Trainer
    from torchtitan_rl.weight_sync.sync import WeightSync

    task = run_task(cfg)
    device = run_device(cfg.job.device)
    shape = run_shape(cfg, task)
    bi = cfg.batch_invariant_mode
    trainer = Trainer(cfg.trainer, model_config=cfg.model, shape=shape, seed=0, device=device,
                      output_dir=out_dir, batch_invariant=bi)
    gen = Engine(cfg.generator, model_config=cfg.model, shape=shape, seed=0, device=device.type,
                 workdir=out_dir, batch_invariant=bi)
    sync = WeightSync(cfg.weight_sync, reference=trainer.sync_state(), generator=gen)
    sync.sync(trainer.sync_state(), version=0)
    rng = random.Random(0)
    P, G, T = cfg.grpo.prompts_per_step, cfg.grpo.group_size, cfg.generator.sampling.temperature

    def generate(i):
        prompts = task.sample_prompts(P, generator=rng)
        return prompts, gen.generate([p.token_ids for p in prompts], n=G, stop_token_ids=[task.eos_id], seed=i)

    def train_step(prompts, r):
        tokens, mask, _ = pack_rollouts(r.prompt_ids, r.completion_ids, r.logprobs, pad_id=task.pad_id)
        rewards = torch.tensor([task.reward(prompts[j // G], c) for j, c in enumerate(r.completion_ids)])
        adv = group_advantages(rewards, group_size=G, norm="group_std")
        old = trainer.token_logprobs(tokens, temperature=T).cpu()
        trainer.train_step(TrainBatch(tokens, mask, old, adv), temperature=T, grpo=cfg.grpo)

    gen_rates, step_times = [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        prompts, r = generate(i)
        gen_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        train_step(prompts, r)  # ends with .item(): the device has finished
        step_s = time.perf_counter() - t1
        n_tokens = sum(len(c) for c in r.completion_ids)
        print(f"[bench_batch_invariant] bi={bi} round {i}: {n_tokens} tokens in {gen_s:.2f} s, "
              f"step {step_s:.2f} s", flush=True)
        if i:  # the first round warms up
            gen_rates.append(n_tokens / gen_s)
            step_times.append(step_s)
    if profile:
        _profile(device, bi, generate=lambda: generate(repeats + 1), train_step=train_step)
    del gen
    return {"tok_s": statistics.median(gen_rates), "step_s": statistics.median(step_times)}


def _profile(device, bi: bool, *, generate, train_step) -> None:
    """Print where one more generate() and train step spend their time (top ops / kernels)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    t0 = time.perf_counter()
    with profile(activities=activities) as gen_prof:
        prompts, r = generate()
    t1 = time.perf_counter()
    with profile(activities=activities) as step_prof:
        train_step(prompts, r)
    t2 = time.perf_counter()
    for what, prof, wall in (("generate", gen_prof, t1 - t0), ("trainer step", step_prof, t2 - t1)):
        events = prof.key_averages()
        # Kernel time summed: well below the wall time means the host (Python, launches) is the bottleneck.
        busy = sum(e.self_device_time_total for e in events) / 1e6 if cuda else 0.0
        print(f"[bench_batch_invariant] profile bi={bi} {what}: {wall:.2f} s under the profiler"
              + (f", kernels {busy:.2f} s" if cuda else ""))
        print(events.table(sort_by=sort, row_limit=20, max_name_column_width=70), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts-per-step", type=int, default=None, help="override grpo.prompts_per_step")
    parser.add_argument("--max-tokens", type=int, default=None, help="override generator.sampling.max_tokens")
    parser.add_argument("--output-dir", default="outputs/bench_batch_invariant")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed rounds, print torch.profiler's top ops/kernels of one more "
                             "generate and train step, in each mode")
    parser.add_argument("--worker-mode", choices=["default", "bi"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    import torch

    from bench_common import run_modes, table, write_section
    from torchtitan_rl.config import load_toml

    base = load_toml(args.config)
    if args.prompts_per_step:
        base = dataclasses.replace(base, grpo=dataclasses.replace(base.grpo, prompts_per_step=args.prompts_per_step))
    if args.max_tokens:
        sampling = dataclasses.replace(base.generator.sampling, max_tokens=args.max_tokens)
        base = dataclasses.replace(base, generator=dataclasses.replace(base.generator, sampling=sampling))
    device = "cuda" if torch.cuda.is_available() and base.job.device != "cpu" else "cpu"
    if device == "cpu":
        from torchtitan_rl import compat

        compat.set_num_threads(1)
    results = run_modes(
        ("default", "bi"), device=device, worker_mode=args.worker_mode, worker_out=args.worker_out,
        compute=lambda mode: measure(
            dataclasses.replace(base, batch_invariant_mode=mode == "bi",
                                grpo=dataclasses.replace(base.grpo, old_logprobs="recompute")),
            repeats=args.repeats, out_dir=Path(args.output_dir) / mode, profile=args.profile,
        ),
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    d, b = results["default"], results["bi"]

    def cost(ratio: float) -> str:  # batch-invariant time / default time
        return f"{ratio:.2f}x slower" if ratio >= 1 else f"{1 / ratio:.2f}x faster"

    rows = [
        ["generator tokens/s", f"{d['tok_s']:.0f}", f"{b['tok_s']:.0f}", cost(d["tok_s"] / b["tok_s"])],
        ["trainer step s (recompute + fwd/bwd + optimizer)", f"{d['step_s']:.3f}", f"{b['step_s']:.3f}",
         cost(b["step_s"] / d["step_s"])],
    ]
    body = table(["measure", "default", "batch-invariant", "cost"], rows)
    body += (
        f"\n{base.grpo.prompts_per_step} prompts x {base.grpo.group_size} samples, up to "
        f"{base.generator.sampling.max_tokens} new tokens, median of {args.repeats} rounds after one warm-up"
        + (f"; generator enforce_eager={base.generator.enforce_eager} in both modes.\n"
           if device == "cuda" else ".\n")
    )
    write_section(f"Batch-invariant cost ({Path(args.config).stem}, {device})", device=device, body=body)


if __name__ == "__main__":
    main()
