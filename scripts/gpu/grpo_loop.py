"""The full GRPO loop on one GPU, with a step-time breakdown.

Runs torchtitan_rl.simple_grpo.train on run_configs/qwen3_0.6b.toml (trainer and
generator colocated, CUDA graphs), then splits each step's wall time:
sync, generate and logprob recompute (from metrics.jsonl), optimizer (timed
here by the optimizer's step hooks, with a device sync at the edges, where the
loop syncs anyway), trainer forward+backward (= train_s - optimizer) and other
(scoring, packing, logging).

    python3 scripts/gpu/grpo_loop.py --steps 20 [--out DIR] [--section.field value ...]
"""

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

SYNC = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from bench_common import table, write_section  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="run_configs/qwen3_0.6b.toml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the medians")
    parser.add_argument("--out", default=None, help="copy metrics.jsonl and a summary JSON here")
    parser.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    parser.add_argument("--diagnose", action="store_true",
                        help="per-step generation diagnostics of scripts/gpu/gen_drift.py in the summary")
    args, overrides = parser.parse_known_args()  # the rest: --section.field value overrides

    t_start = time.perf_counter()
    import torchtitan_rl.compat  # noqa: F401
    from torchtitan_rl.config import parse_args
    from torchtitan_rl.run.memory_watch import device_readings
    from torchtitan_rl.simple_grpo import train

    workdir = Path(tempfile.mkdtemp(prefix="grpo_"))
    argv = ["--config", args.config, "--trainer.steps", str(args.steps), "--job.output_dir", str(workdir),
            "--trainer.checkpoint.enable", "false", *overrides]
    cfg = parse_args(argv)

    optimizer, opt_start = [], []

    def pre_hook(opt, *_):
        SYNC()
        opt_start.append(time.perf_counter())

    def post_hook(opt, *_):
        SYNC()
        optimizer.append(time.perf_counter() - opt_start[-1])

    register_optimizer_step_pre_hook(pre_hook)
    register_optimizer_step_post_hook(post_hook)

    diagnostics: list = []
    if args.diagnose:
        from gen_drift import install

        install(diagnostics)
    history = train(cfg)
    wall = time.perf_counter() - t_start
    assert len(history) == len(optimizer) == args.steps, (len(history), len(optimizer))  # one optimizer step a step
    steps = []
    for rec, op in zip(history, optimizer):
        parts = {
            "sync": rec["sync_s"],
            "generate": rec["generate_s"],
            "trainer logprob recompute (fwd)": rec["recompute_s"],  # 0 with grpo.old_logprobs train
            "trainer fwd+bwd (+clip)": rec["train_s"] - op,
            "optimizer (AdamW, fp32)": op,
        }
        parts["other"] = rec["step_s"] - sum(parts.values())
        steps.append({"step": rec["step"], "step_s": rec["step_s"], **parts,
                      "gen_tokens_per_s": rec["gen_tokens_per_s"], "mismatch_max": rec["mismatch_max"],
                      "mismatch_mean": rec["mismatch_mean"], "mismatch_frac_tokens": rec["mismatch_frac_tokens"],
                      "reward_mean": rec["reward_mean"]})
    kept = steps[args.skip:] or steps
    med = {k: statistics.median(s[k] for s in kept) for k in kept[0] if k != "step"}
    summary = {
        "steps": args.steps, "skipped": args.skip, "wall_s": wall, "first_step_s": steps[0]["step_s"],
        "median": med, "per_step": steps, "config": argv,
        # the loop's phase readings (run/memory_watch.py): torch's own peak counter is reset at each phase
        "peak_gpu_mem_gib": max((v for rec in history for v in device_readings(rec).values()), default=0.0),
        "generate_diagnostics": diagnostics,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "per_step"}, indent=1))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(workdir / "latest" / "metrics.jsonl", out / "grpo_metrics.jsonl")
        (out / "grpo_summary.json").write_text(json.dumps(summary, indent=1))

    parts = [k for k in kept[0] if k not in ("step", "step_s", "gen_tokens_per_s", "mismatch_max",
                                             "mismatch_mean", "mismatch_frac_tokens", "reward_mean")]
    rows = [[k, f"{med[k] * 1e3:.1f}", f"{100 * med[k] / med['step_s']:.2f}%"] for k in parts]
    rows.append(["step (median)", f"{med['step_s'] * 1e3:.1f}", "100%"])
    g, s = cfg.grpo, cfg.generator
    body = (
        f"`{args.config}`, {args.steps} steps, medians over steps {args.skip}..{args.steps - 1} "
        f"(step 0: {steps[0]['step_s']:.1f} s with warm-ups). Qwen3-{cfg.model.flavor} shape, random weights; "
        f"{g.prompts_per_step} prompts x {g.group_size} samples, up to {s.sampling.max_tokens} new tokens "
        f"(random weights rarely emit <eos>, so nearly every sample runs to the limit); generator "
        f"enforce_eager={s.enforce_eager}, gpu_memory_utilization={s.gpu_memory_utilization}, "
        f"max_num_seqs={s.max_num_seqs}; trainer micro_batch_size={cfg.trainer.micro_batch_size}, "
        f"micro_batch_tokens={cfg.trainer.micro_batch_tokens}, "
        f"logprob_chunk_tokens={cfg.trainer.logprob_chunk_tokens}, "
        f"compile={cfg.trainer.compile}.\n\n"
        + table(["part", "median ms", "share of step"], rows)
        + f"\nGeneration {med['gen_tokens_per_s']:.0f} tokens/s inside the loop; trainer-vs-generator "
        f"logprob mismatch: median per-step max {med['mismatch_max']:.2e}, mean {med['mismatch_mean']:.2e}; "
        f"tokens that differ, worst step of all {args.steps}: "
        f"{100 * max(s['mismatch_frac_tokens'] for s in steps):.2f}%. "
        f"Sync = {100 * med['sync'] / med['step_s']:.3f}% of the step. Peak GPU memory held (trainer + "
        f"generator, one process, every allocator and the CUDA context): {summary['peak_gpu_mem_gib']:.1f} GiB. "
        f"Whole run incl. startup: {wall:.0f} s.\n"
    )
    rates = [s["gen_tokens_per_s"] for s in kept]
    body += (
        f"\nGeneration per step, steps {args.skip}..{args.steps - 1}: min {min(rates):.0f}, median "
        f"{statistics.median(rates):.0f}, max {max(rates):.0f} tokens/s (spread (max - min) / median "
        f"{100 * (max(rates) - min(rates)) / statistics.median(rates):.1f}%); every step: "
        + ", ".join(f"{s['gen_tokens_per_s'] / 1e3:.1f}k" for s in steps) + ".\n"
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mode = ", batch-invariant" if cfg.batch_invariant_mode else ""
    if not args.no_write:
        write_section(f"GRPO loop step breakdown{mode} ({device})", device=device, body=body)


if __name__ == "__main__":
    main()
