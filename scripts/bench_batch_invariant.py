"""Cost of batch-invariant mode: generator tokens/s and trainer step time vs default.

Same config, same process; default mode first (CPU batch-invariant mode pins
torch to one thread for the process, so default mode is also measured with
one thread, after the engine reduced it, for a fair ratio).

    python scripts/bench_batch_invariant.py --config run_configs/cpu_tiny.toml
"""

import argparse
import dataclasses
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def measure(cfg, *, repeats: int, out_dir: Path) -> dict:
    import statistics

    import torch

    from torchtitan_rl.generator.generator import Generator
    from torchtitan_rl.grpo import build_task, group_advantages
    from torchtitan_rl.grpo.batch import pack_rollouts
    from torchtitan_rl.models.qwen3 import resolve_shape
    from torchtitan_rl.simple_grpo import _device
    from torchtitan_rl.trainer import TrainBatch, Trainer
    from torchtitan_rl.weight_sync import WeightSync

    task = build_task(cfg.grpo.task)
    device = _device(cfg.job.device)
    shape = resolve_shape(flavor=cfg.model.flavor, hf_checkpoint=cfg.model.hf_checkpoint,
                          vocab_size=cfg.model.vocab_size or (task.vocab_size if cfg.model.flavor == "tiny" else 0),
                          max_seq_len=cfg.model.max_seq_len)
    bi = cfg.batch_invariant_mode
    trainer = Trainer(cfg.trainer, model_config=cfg.model, shape=shape, seed=0, device=device,
                      output_dir=out_dir, batch_invariant=bi)
    gen = Generator(cfg.generator, model_config=cfg.model, shape=shape, seed=0, device=device.type,
                    workdir=out_dir, batch_invariant=bi)
    sync = WeightSync(cfg.weight_sync, reference=trainer.sync_state(), generator=gen)
    sync.sync(trainer.sync_state(), version=0)
    rng = random.Random(0)
    P, G, T = cfg.grpo.prompts_per_step, cfg.grpo.group_size, cfg.generator.sampling.temperature
    gen_rates, step_times = [], []
    for i in range(repeats + 1):
        prompts = task.sample_prompts(P, generator=rng)
        t0 = time.perf_counter()
        r = gen.generate([p.token_ids for p in prompts], n=G, stop_token_ids=[task.eos_id], seed=i)
        gen_s = time.perf_counter() - t0
        tokens, mask, _ = pack_rollouts(r.prompt_ids, r.completion_ids, r.logprobs, pad_id=task.pad_id)
        rewards = torch.tensor([task.reward(prompts[j // G], c) for j, c in enumerate(r.completion_ids)])
        adv = group_advantages(rewards, group_size=G, norm="group_std")
        t1 = time.perf_counter()
        old = trainer.token_logprobs(tokens, temperature=T).cpu()
        trainer.train_step(TrainBatch(tokens, mask, old, adv), temperature=T, grpo=cfg.grpo)
        step_s = time.perf_counter() - t1
        if i:  # the first round warms up
            gen_rates.append(sum(len(c) for c in r.completion_ids) / gen_s)
            step_times.append(step_s)
    del gen
    return {"tok_s": statistics.median(gen_rates), "step_s": statistics.median(step_times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-dir", default="outputs/bench_batch_invariant")
    args = parser.parse_args()

    import torch

    from bench_common import table, write_section
    from torchtitan_rl.config import load_toml

    base = load_toml(args.config)
    results = {}
    for bi in (False, True):
        cfg = dataclasses.replace(base, batch_invariant_mode=bi)
        results[bi] = measure(cfg, repeats=args.repeats, out_dir=Path(args.output_dir) / str(bi))
    d, b = results[False], results[True]
    rows = [
        ["generator tokens/s", f"{d['tok_s']:.0f}", f"{b['tok_s']:.0f}", f"{d['tok_s'] / b['tok_s']:.2f}x slower"],
        ["trainer step s (recompute + fwd/bwd + optimizer)", f"{d['step_s']:.3f}", f"{b['step_s']:.3f}",
         f"{b['step_s'] / d['step_s']:.2f}x slower"],
    ]
    body = table(["measure", "default", "batch-invariant", "cost"], rows)
    device = "cuda" if torch.cuda.is_available() and base.job.device != "cpu" else "cpu"
    write_section(f"Batch-invariant cost ({Path(args.config).stem}, {device})", device=device, body=body)


if __name__ == "__main__":
    main()
