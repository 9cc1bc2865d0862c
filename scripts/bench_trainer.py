"""Trainer throughput: logprob recompute and forward+backward, tokens/s and MFU, per trainer setting.

One GRPO step's batch from the config (prompts from its task, P x G rows;
completions of random ids, every one ``max_tokens`` long as on random weights,
or with --ragged uniform in [1, max_tokens]), then for each variant (trainer
overrides on top of the config) a fresh Trainer: one warm-up, then the median
of --repeats timed calls of ``token_logprobs`` (the recompute, no grad) and of
``train_step`` minus its optimizer step (forward+backward+clip), each with its
peak device memory (torch's allocator, the trainer alone).

FLOPs (model FLOPs: work the result needs, not what a variant recomputes):
  matmul params N_body = every Linear's weight but the lm_head (the embedding is a lookup);
  forward = 2 * N_body * tokens + 2 * V * D * scored + attention,
  attention = 4 * layers * heads * head_dim * sum over rows of L(L+1)/2 (causal: query t sees t+1 keys),
  recompute = forward, forward+backward = 3 * forward,
where tokens = all non-padding tokens (prompt + completion), scored = completion
tokens (the positions whose logprob is used; the old path computed the lm_head at
every position, padding included, the chunked path at scored ones only).
MFU = FLOPs / time / peak, peak = dense bf16 of the GPU (H100/H200 SXM: 989.4 TFLOP/s).

    python scripts/bench_trainer.py --config run_configs/qwen3_0.6b.toml [--ragged] [--profile]
"""

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from torchtitan_rl.run.startup import allocator_defaults

ALLOC_CONF = allocator_defaults()  # before torch's import: the allocator as simple_grpo runs the trainer

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import synchronize, table, write_section  # noqa: E402

PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12}
"""Dense bf16 tensor-core peak (NVIDIA's datasheet, SXM) by device-name substring."""

def _variant(chunk: int, rows: int, tokens: int, compile: bool, ac: str = "none") -> list[str]:
    """Every knob set, so a config's own choice never leaks into a variant."""
    return ["--trainer.logprob_chunk_tokens", str(chunk), "--trainer.micro_batch_size", str(rows),
            "--trainer.micro_batch_tokens", str(tokens), "--trainer.compile", str(compile).lower(),
            "--trainer.activation_checkpoint", ac]


VARIANTS = {
    "before: whole logits, 32 rows": _variant(0, 32, 0, False),
    "chunked logprobs, 32 rows": _variant(2048, 32, 0, False),
    "chunked + compile, 32 rows": _variant(2048, 32, 0, True),
    "chunked + compile, 16k tokens": _variant(2048, 512, 16384, True),
    "chunked + compile, 32k tokens": _variant(2048, 512, 32768, True),
    "chunked + compile + full AC, 64k tokens": _variant(2048, 512, 65536, True, "full"),
    # rows of 8k-16k tokens (the long tail's: scripts/gpu/long_tail.sh); budgets at least generator.max_model_len
    "chunked + compile + full AC, 32k tokens": _variant(2048, 512, 32768, True, "full"),
    "chunked + compile + full AC, 128k tokens": _variant(2048, 512, 131072, True, "full"),
}


def model_flops(shape, lengths: list[int], scored: int, *, matmul_params: int) -> float:
    """Forward FLOPs of the batch (module docstring)."""
    tokens = sum(lengths)
    per_pair = 4 * shape.num_hidden_layers * shape.num_attention_heads * shape.head_dim
    attention = per_pair * sum(n * (n + 1) // 2 for n in lengths)
    return 2 * matmul_params * tokens + 2 * shape.vocab_size * shape.hidden_size * scored + attention


def make_batch(cfg, task, shape, *, ragged: bool, harness: bool = False, seed: int = 0):
    from torchtitan_rl.engine.lengths import response_length
    from torchtitan_rl.grpo.batch import pack_rollouts

    rng = random.Random(seed)
    P, G, T = cfg.grpo.prompts_per_step, cfg.grpo.group_size, cfg.generator.sampling.max_tokens
    prompts = [p.token_ids for p in task.sample_prompts(P, generator=rng) for _ in range(G)]
    if harness:  # the lengths the loop's engine would draw for a request seeded `seed` (engine/lengths.py)
        drawn = [response_length(cfg.grpo.harness_lengths, cap=T, seed=seed, prompt=i // G, sample=i % G) or T
                 for i in range(P * G)]
        completions = [[rng.randrange(1, shape.vocab_size) for _ in range(n)] for n in drawn]
    else:
        completions = [[rng.randrange(1, shape.vocab_size) for _ in range(rng.randint(1, T) if ragged else T)]
                       for _ in prompts]
    tokens, mask, _ = pack_rollouts(prompts, completions, [[0.0] * len(c) for c in completions], pad_id=task.pad_id)
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    return tokens, mask, lengths


def measure(cfg, shape, batch, *, repeats: int, profile: bool) -> dict:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from torchtitan_rl.run.parts import run_device
    from torchtitan_rl.trainer import TrainBatch, Trainer

    device = run_device(cfg.job.device)
    tokens, mask, _ = batch
    T = cfg.generator.sampling.temperature
    trainer = Trainer(cfg.trainer, model_config=cfg.model, shape=shape, seed=0, device=device,
                      output_dir=Path(tempfile.mkdtemp()))
    adv = torch.randn(tokens.shape[0], generator=torch.Generator().manual_seed(0))
    opt_times = []
    marks = {}

    def before_step(*_):
        synchronize(device.type)
        marks["t"] = time.perf_counter()

    def after_step(*_):
        synchronize(device.type)
        opt_times.append(time.perf_counter() - marks["t"])

    pre, post = register_optimizer_step_pre_hook(before_step), register_optimizer_step_post_hook(after_step)

    def recompute():
        return trainer.token_logprobs(tokens, temperature=T, mask_BL=mask)

    def step(old):
        trainer.train_step(TrainBatch(tokens, mask, old, adv), temperature=T, grpo=cfg.grpo)

    def timed(fn, *args):
        """fn's result, seconds, and the most torch's allocator held in tensors and reserved (GiB, CUDA) while it ran;
        the blocks cached before it are returned to the driver first, so that reserved beyond allocated is the
        blocks fn's own tensors left unusable (as the loop's recompute, which follows the engine's wake)."""
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        synchronize(device.type)
        t = time.perf_counter()
        out = fn(*args)
        synchronize(device.type)
        peak = (torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30) if cuda \
            else (0.0, 0.0)
        return out, time.perf_counter() - t, peak

    rec_s, fb_s, rec_peak, fb_peak = [], [], [], []
    for i in range(repeats + 1):  # the first round warms up (and compiles)
        old, s, peak = timed(recompute)
        old = old.cpu()
        _, s2, peak2 = timed(step, old)
        if i:
            rec_s.append(s)
            rec_peak.append(peak)
            fb_s.append(s2 - opt_times[-1])
            fb_peak.append(peak2)
    pre.remove()
    post.remove()
    if profile and device.type == "cuda":
        _profile(lambda: step(old))
    result = {"recompute_s": statistics.median(rec_s), "fwd_bwd_s": statistics.median(fb_s),
              "recompute_peak_gib": max(p for p, _ in rec_peak), "fwd_bwd_peak_gib": max(p for p, _ in fb_peak),
              "recompute_reserved_gib": max(r for _, r in rec_peak), "fwd_bwd_reserved_gib": max(r for _, r in fb_peak),
              "optimizer_s": statistics.median(opt_times[1:]),
              "matmul_params": sum(m.weight.numel() for n, m in trainer.model.named_modules()
                                   if isinstance(m, torch.nn.Linear) and n != "lm_head"),
              "old_logprobs": old}
    del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _profile(fn) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


def gemm_ceiling(n: int = 8192) -> float:
    """bf16 TFLOP/s of an n^3 matmul: what this GPU's tensor cores give here."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * 10 / (time.perf_counter() - t) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="run_configs/qwen3_0.6b.toml")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), help="names of VARIANTS, in order")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ragged", action="store_true", help="completion lengths uniform in [1, max_tokens]")
    parser.add_argument("--harness-lengths", action="store_true",
                        help="completion lengths drawn from the config's grpo.harness_lengths (as the loop's engine)")
    parser.add_argument("--profile", action="store_true", help="torch.profiler's top kernels of the last variant's step")
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    args, overrides = parser.parse_known_args()

    import torchtitan_rl.compat  # noqa: F401
    from torchtitan_rl.config import parse_args
    from torchtitan_rl.run.parts import run_shape, run_task

    base = ["--config", args.config, "--trainer.checkpoint.enable", "false", *overrides]
    cfg0 = parse_args(base)
    task = run_task(cfg0)
    shape = run_shape(cfg0, task)
    batch = make_batch(cfg0, task, shape, ragged=args.ragged, harness=args.harness_lengths)
    tokens, mask, lengths = batch
    scored = int(mask.sum().item())
    device = "cuda" if torch.cuda.is_available() and cfg0.job.device != "cpu" else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if device == "cuda" and k in torch.cuda.get_device_name()), None)
    ceiling = gemm_ceiling() if device == "cuda" else None

    results, reference = {}, None
    for i, name in enumerate(args.variants):
        cfg = parse_args(base + VARIANTS[name])
        print(f"[bench_trainer] {name} ...", flush=True)
        try:
            r = measure(cfg, shape, batch, repeats=args.repeats, profile=args.profile and i == len(args.variants) - 1)
        except torch.OutOfMemoryError as e:  # a setting too big for this GPU is a result, not the end of the run
            print(f"[bench_trainer] {name}: out of memory: {str(e).splitlines()[0]}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
            continue
        old = r.pop("old_logprobs")
        # Every variant computes the same logprobs up to bf16 rounding: a wrong path would not.
        r["max_abs_diff_vs_first"] = 0.0 if reference is None else (old - reference)[mask.bool()].abs().max().item()
        reference = old if reference is None else reference
        fwd = model_flops(shape, lengths, scored, matmul_params=r["matmul_params"])
        r.update(tokens=sum(lengths), scored_tokens=scored, fwd_flops=fwd)
        for part, mult in (("recompute", 1), ("fwd_bwd", 3)):
            s = r[f"{part}_s"]
            r[f"{part}_tokens_per_s"] = sum(lengths) / s
            r[f"{part}_tflops"] = mult * fwd / s / 1e12
            r[f"{part}_mfu"] = mult * fwd / s / peak if peak else None
        results[name] = r
        print(f"[bench_trainer] {name}: {json.dumps(r)}", flush=True)

    if args.json:
        # torch's allocator settings change the reserved bytes it records: the JSON says which ran
        Path(args.json).write_text(json.dumps({"results": results, "gemm_tflops": ceiling, "peak": peak,
                                               "alloc_conf": ALLOC_CONF}, indent=1))

    def pct(x):
        return f"{100 * x:.1f}%" if x is not None else "n/a"

    rows = [[name, f"{r['recompute_s']:.3f}", f"{r['recompute_tokens_per_s']:,.0f}", pct(r["recompute_mfu"]),
             f"{r['recompute_peak_gib']:.1f}", f"{r['fwd_bwd_s']:.3f}", f"{r['fwd_bwd_tokens_per_s']:,.0f}",
             pct(r["fwd_bwd_mfu"]), f"{r['fwd_bwd_peak_gib']:.1f}", f"{r['max_abs_diff_vs_first']:.1e}"]
            for name, r in results.items()]
    P, G = cfg0.grpo.prompts_per_step, cfg0.grpo.group_size
    r0 = next(iter(results.values()))
    T = cfg0.generator.sampling.max_tokens
    body = (
        f"`{args.config}` trainer alone: {P} prompts x {G} samples, completions "
        f"{'drawn from grpo.harness_lengths' if args.harness_lengths else f'uniform in [1, {T}]' if args.ragged else f'all {T}'}"
        f" tokens: {r0['tokens']:,} tokens "
        f"({r0['scored_tokens']:,} scored) padded to {tokens.shape[0]} x {tokens.shape[1]}; median of "
        f"{args.repeats} after a warm-up. MFU = model FLOPs / time / "
        f"{f'{peak / 1e12:.1f} TFLOP/s (dense bf16 peak)' if peak else 'n/a'}; forward FLOPs = "
        f"2 x {r0['matmul_params'] / 1e6:.0f} M matmul params x tokens + 2 x V x D x scored + causal attention "
        f"4 x layers x heads x head_dim x sum L(L+1)/2 = {r0['fwd_flops'] / 1e12:.1f} TFLOP; fwd+bwd = 3x forward "
        f"(the backward's recompute of the logits is not counted). Peak = torch's max allocated during the call, "
        f"trainer only (fp32 masters, grads, AdamW state included)."
        + (f" An 8192^3 bf16 matmul runs at {ceiling:.0f} TFLOP/s on this GPU." if ceiling else "")
        + "\n\n"
    )
    body += table(["trainer setting", "recompute s", "tokens/s", "MFU", "peak GiB", "fwd+bwd s", "tokens/s",
                   "MFU", "peak GiB", "max abs dlogprob vs first"], rows)
    if not args.no_write:
        suffix = ", ragged" if args.ragged else ""
        write_section(f"Trainer throughput (qwen3_0.6b{suffix}, {device})", device=device, body=body)


if __name__ == "__main__":
    main()
