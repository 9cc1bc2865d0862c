"""Are the generator's sampling logprobs bitwise equal to the trainer's recompute?

Builds trainer and generator from a config, syncs the trainer's weights,
generates with several batch sizes, recomputes every sampled token's logprob
on the trainer (in one differently composed batch), and prints a table for
default mode and batch-invariant mode. Exit code 0 only if batch-invariant
mode shows zero differing tokens. On CUDA each mode runs in its own process
(vLLM engines keep their GPU memory; the batch-invariant overrides are
process-wide).

    python scripts/check_bitwise_identity.py --config run_configs/cpu_tiny.toml
"""

import argparse
import dataclasses
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def compare(cfg, *, batch_sizes: list[int], out_dir: Path) -> list[list]:
    """One mode: rows of (mode, batch size, tokens, differing, max |diff|)."""
    import torch

    from torchtitan_rl.engine.engine import Engine
    from torchtitan_rl.grpo.batch import pack_rollouts
    from torchtitan_rl.run.parts import run_device, run_shape, run_task
    from torchtitan_rl.trainer import Trainer
    from torchtitan_rl.weight_sync.sync import WeightSync

    task = run_task(cfg)
    device = run_device(cfg.job.device)
    shape = run_shape(cfg, task)
    bi = cfg.batch_invariant_mode
    trainer = Trainer(cfg.trainer, model_config=cfg.model, shape=shape, seed=cfg.job.seed,
                      device=device, output_dir=out_dir, batch_invariant=bi)
    generator = Engine(cfg.generator, model_config=cfg.model, shape=shape, seed=cfg.job.seed,
                       device=device.type, workdir=out_dir, batch_invariant=bi)
    WeightSync(cfg.weight_sync, reference=trainer.sync_state(), generator=generator).sync(
        trainer.sync_state(), version=1
    )
    rng = random.Random(cfg.job.seed)
    temperature = cfg.generator.sampling.temperature
    rows = []
    for batch in batch_sizes:
        prompts = task.sample_prompts(batch, generator=rng)
        r = generator.generate([p.token_ids for p in prompts], n=1, stop_token_ids=[task.eos_id], seed=batch)
        tokens_BL, mask_BL, gen_BL = pack_rollouts(r.prompt_ids, r.completion_ids, r.logprobs, pad_id=task.pad_id)
        # Recompute in reverse order so no row sits where it sat in the generator's batch.
        flip = torch.arange(tokens_BL.shape[0] - 1, -1, -1)
        trainer_BL = trainer.token_logprobs(tokens_BL[flip], temperature=temperature).cpu()[flip]
        valid = mask_BL.bool()
        diff = (trainer_BL[valid] - gen_BL[valid]).abs()
        rows.append(["batch-invariant" if bi else "default", batch, int(valid.sum()),
                     int((diff != 0).sum()), f"{diff.max().item():.3g}"])
        print(f"[bitwise] {rows[-1]}", flush=True)
    del generator
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 7, 64])
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="override generator.sampling.max_tokens (longer sequences cross more key tiles)")
    parser.add_argument("--output-dir", default="outputs/bitwise_check")
    parser.add_argument("--write-benchmarks", action="store_true", help="record the table in docs/benchmarks.md")
    parser.add_argument("--worker-mode", choices=["default", "bi"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    import torch

    from torchtitan_rl.config import load_toml, validate
    from bench_common import run_modes, table, write_section

    base = load_toml(args.config)
    if args.max_tokens:
        sampling = dataclasses.replace(base.generator.sampling, max_tokens=args.max_tokens)
        base = dataclasses.replace(base, generator=dataclasses.replace(base.generator, sampling=sampling))
    validate(base)
    device = "cuda" if torch.cuda.is_available() and base.job.device != "cpu" else "cpu"
    # Default first: CPU batch-invariant mode pins torch to one thread for the process.
    results = run_modes(
        ("default", "bi"), device=device, worker_mode=args.worker_mode, worker_out=args.worker_out,
        compute=lambda mode: compare(
            dataclasses.replace(base, batch_invariant_mode=mode == "bi",
                                grpo=dataclasses.replace(base.grpo, old_logprobs="recompute")),
            batch_sizes=args.batch_sizes, out_dir=Path(args.output_dir) / mode,
        ),
    )
    rows = results["default"] + results["bi"]
    body = table(["mode", "prompts in batch", "tokens compared", "tokens different", "max abs diff"], rows)
    body += (
        f"\nTrainer and generator built from {Path(args.config).name} "
        f"({'weights of ' + base.model.hf_checkpoint if base.model.hf_checkpoint else 'random weights'}, one sync), one sample per "
        f"prompt, T={base.generator.sampling.temperature}, up to {base.generator.sampling.max_tokens} new tokens; "
        f"the trainer recomputes the rows in reverse order (micro-batches of {base.trainer.micro_batch_size}).\n"
    )
    print(body)
    if args.write_benchmarks:
        write_section(f"Bitwise identity ({Path(args.config).stem}, {device})", device=device, body=body)
    ok = all(r[3] == 0 for r in rows if r[0] == "batch-invariant")
    print("PASS: batch-invariant mode is bitwise identical" if ok else "FAIL: batch-invariant mode differs")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
