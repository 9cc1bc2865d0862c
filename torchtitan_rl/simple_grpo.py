"""GRPO, end to end: python -m torchtitan_rl.simple_grpo --config run_configs/cpu_tiny.toml

Each step: sync -> generate -> score -> advantages -> recompute logprobs ->
loss + optimizer step -> log. Every rank runs this file (torchrun for more
than one). Where the vLLM generator runs is weight_sync.transport:
"inplace", in trainer rank 0's process (generator/colocated.py); "nccl", on
the last torchrun rank, its own device (generator/remote.py), the other
ranks train. The step body is the same for both. Heavy imports stay inside
``run`` so that --help and config errors are instant.
"""

import os
import time
from pathlib import Path

from torchtitan_rl.cli import one_line_errors
from torchtitan_rl.config import JobConfig, parse_args, write_toml
from torchtitan_rl.config.loader import effective_task, tokenizer_dir


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)  # exits 2 with one "config error: ..." line on bad input
    if cfg.dry_run:
        write_toml(cfg, Path(cfg.job.output_dir) / "config.toml")
        print(f"torchtitan_rl: config valid; written to {Path(cfg.job.output_dir) / 'config.toml'}")
        return
    with one_line_errors():  # user errors found past parsing: a checkpoint, a task, mismatched weights
        run(cfg)
    # After a successful run only (as torchtitan: after a failure some ranks may
    # still be inside a collective). Left to interpreter teardown, gloo's worker
    # threads can still hold tensors and abort a finished rank (SIGABRT, "terminate
    # called without an active exception", seen once in a 3-process CPU run).
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run(cfg: JobConfig) -> list[dict]:
    """Train; returns the per-step metrics (rank 0 has them all; the generator rank none)."""
    import random

    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from torchtitan_rl.config import validate
    from torchtitan_rl.generator.colocated import ColocatedGenerator
    from torchtitan_rl.generator.remote import RemoteGenerator, serve
    from torchtitan_rl.grpo import group_advantages
    from torchtitan_rl.grpo.batch import logprob_mismatch, pack_rollouts
    from torchtitan_rl.grpo.evaluate import Evaluator
    from torchtitan_rl.metrics import MetricsLogger
    from torchtitan_rl.trainer import Trainer
    from torchtitan_rl.trainer.trainer import TrainBatch
    from torchtitan_rl.weight_sync import init_world

    started = time.perf_counter()
    out = Path(cfg.job.output_dir)
    task = run_task(cfg)
    device = run_device(cfg.job.device)
    shape = run_shape(cfg, task)
    if cfg.job.export_dir is not None:
        from torchtitan_rl.export import check_target

        check_target(cfg.job.export_dir)  # before training, not after it
    world = None
    if cfg.weight_sync.transport == "nccl":
        # parse_args checked this layout against torchrun's world; run(cfg) may come from Python.
        validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        world = init_world(device.type)  # before the Trainer, which then takes the trainer ranks' default group
        if world.role == "generator":
            serve(cfg, world=world, shape=shape, workdir=out)
            return []

    def build_trainer() -> Trainer:
        return Trainer(
            cfg.trainer, model_config=cfg.model, shape=shape, seed=cfg.job.seed,
            device=device, output_dir=out, batch_invariant=cfg.batch_invariant_mode,
        )

    evaluator = None
    if cfg.eval.every_n_steps:
        evaluator = Evaluator(cfg.eval, task=task, spec=effective_task(cfg), sampling=cfg.generator.sampling,
                              seed=cfg.job.seed)
    trainer = build_trainer()
    reference = build_trainer() if cfg.grpo.kl_coef > 0 else None  # frozen initial policy
    rank = dist.get_rank()
    P, G = cfg.grpo.prompts_per_step, cfg.grpo.group_size
    if (P * G) % trainer.dp_size:
        raise ValueError(
            f"grpo.prompts_per_step * grpo.group_size ({P * G}) must divide over {trainer.dp_size} data-parallel ranks"
        )
    if rank == 0:
        write_toml(cfg, out / "config.toml")
    generator = None
    try:
        # The generator as the loop sees it, in either layout: sync, rollouts, close.
        if world is None:
            generator = ColocatedGenerator(cfg, reference=trainer.sync_state(), shape=shape, device=device, workdir=out)
        else:
            generator = RemoteGenerator(cfg, reference=trainer.sync_state(), world=world)

        prompt_rng = random.Random(cfg.job.seed)
        start = 0
        if cfg.resume:
            extra = trainer.load_latest_checkpoint()
            if extra is not None:
                prompt_rng.setstate(_tuples(extra["prompt_rng"]))
                task.load_state_dict(extra.get("task", {}))  # a dataset's place in its epoch
                start = trainer.step

        temperature = cfg.generator.sampling.temperature
        logger = MetricsLogger(out, enabled=rank == 0)
        bar = tqdm(range(start, cfg.trainer.steps), disable=rank != 0, desc=cfg.job.name, dynamic_ncols=True)
        for step in bar:
            t_step = time.perf_counter()
            # 1. sync: the generator serves the trainer's current weights (negative
            #    control: only the first sync, so the generator keeps step-0 weights).
            sync_s = 0.0
            if cfg.weight_sync.enable or step == start:
                sync_s = generator.sync(trainer.sync_state(), version=step)

            # 2. generate; every rank gets the rollouts.
            prompts = task.sample_prompts(P, generator=prompt_rng)
            t_gen = time.perf_counter()
            rollouts = generator.rollouts(
                [p.token_ids for p in prompts], n=G, stop_token_ids=[task.eos_id],
                seed=cfg.job.seed * 1_000_003 + step,
            )
            gen_s = time.perf_counter() - t_gen
            # held-out accuracy of the same weights; the training samples above are already drawn
            if evaluator and evaluator.due(step, first=start):
                logger.log_eval(step, evaluator.run(generator, step=step))

            # 3. score, 4. group-relative advantages
            rewards_B = torch.tensor(
                [task.reward(prompts[i // G], c) for i, c in enumerate(rollouts.completion_ids)]
            )
            advantages_B = group_advantages(rewards_B, group_size=G, norm=cfg.grpo.advantage_norm)

            # 5. this rank's rows; the trainer recomputes their logprobs
            tokens_BL, mask_BL, gen_lp_BL = pack_rollouts(
                rollouts.prompt_ids, rollouts.completion_ids, rollouts.logprobs, pad_id=task.pad_id
            )
            # Tensor-parallel peers share a data shard: split over data-parallel ranks only.
            per_rank = P * G // trainer.dp_size
            rows = slice(trainer.dp_rank * per_rank, (trainer.dp_rank + 1) * per_rank)
            trainer_lp_BL = trainer.token_logprobs(tokens_BL[rows], temperature=temperature, mask_BL=mask_BL[rows]).cpu()
            mismatch = _reduce_mismatch(
                logprob_mismatch(trainer_lp_BL, gen_lp_BL[rows], mask_BL[rows]), mask_BL[rows], device
            )
            ref_lp_BL = (
                reference.token_logprobs(tokens_BL[rows], temperature=temperature, mask_BL=mask_BL[rows]).cpu()
                if reference else None
            )

            # 6. clipped policy-gradient step
            t_train = time.perf_counter()
            metrics = trainer.train_step(
                TrainBatch(tokens_BL[rows], mask_BL[rows], trainer_lp_BL, advantages_B[rows], ref_lp_BL),
                temperature=temperature, grpo=cfg.grpo,
            )
            train_s = time.perf_counter() - t_train

            if cfg.trainer.checkpoint.enable and (step + 1) % cfg.trainer.checkpoint.interval == 0:
                trainer.save_checkpoint(
                    step + 1, extra={"prompt_rng": prompt_rng.getstate(), "task": task.state_dict()}
                )

            # 7. log
            completion_tokens = sum(len(c) for c in rollouts.completion_ids)
            record = {
                "reward_mean": rewards_B.mean().item(),
                "reward_max": rewards_B.max().item(),
                **metrics,
                **mismatch,
                "weight_version": rollouts.weight_version,
                "gen_tokens_per_s": completion_tokens / max(gen_s, 1e-9),
                "sync_s": sync_s,
                "generate_s": gen_s,
                "train_s": train_s,
                "step_s": time.perf_counter() - t_step,
            }
            logger.log(step, record)
            bar.set_postfix(
                reward=f"{record['reward_mean']:.3f}", loss=f"{record['loss']:.4f}", kl=f"{record['kl']:.4f}",
                mismatch=f"{record['mismatch_mean']:.1e}", tok_s=f"{record['gen_tokens_per_s']:.0f}",
            )

        if evaluator and start < cfg.trainer.steps:
            final_evaluation(cfg, evaluator, generator, trainer, logger)
        if cfg.job.export_dir is not None:  # every trainer rank: sharded tensors are gathered
            from torchtitan_rl.export import export_hf

            export_hf(trainer.sync_state(), shape=shape, out_dir=cfg.job.export_dir,
                      tokenizer_dir=tokenizer_dir(cfg), lora=cfg.model.lora, dtype=cfg.model.dtype)
        plot = logger.close()
        history = logger.history
        if rank == 0 and history:
            k = max(1, min(5, len(history) // 4))
            first = sum(r["reward_mean"] for r in history[:k]) / k
            last = sum(r["reward_mean"] for r in history[-k:]) / k
            held_out = ""
            if logger.eval_history:
                a, b = logger.eval_history[0], logger.eval_history[-1]
                held_out = (
                    f"held-out accuracy {a['eval_accuracy']:.3f} (step {a['step']}) -> "
                    f"{b['eval_accuracy']:.3f} (step {b['step']}); "
                )
            print(
                f"torchtitan_rl: {held_out}mean reward {first:.3f} (first {k} steps) -> {last:.3f} (last {k} steps); "
                f"steps {start}..{cfg.trainer.steps}; wall {time.perf_counter() - started:.1f} s; "
                f"metrics {out / 'metrics.jsonl'}; plot {plot}"
            )
        return history
    finally:
        if generator is not None:
            generator.close()


def final_evaluation(cfg: JobConfig, evaluator, generator, trainer, logger) -> None:
    """Held-out accuracy of the trained weights (one more sync: no step generated with them)."""
    version = cfg.trainer.steps
    if cfg.weight_sync.enable:  # the negative control's generator keeps serving step-0 weights
        generator.sync(trainer.sync_state(), version=version)
    logger.log_eval(version, evaluator.run(generator, step=version))


def run_task(cfg: JobConfig):
    """The run's task (config.loader.effective_task) built with the task section and its tokenizer folder
    (task.tokenizer, else the checkpoint's)."""
    from torchtitan_rl.grpo import build_task

    spec = effective_task(cfg)
    if spec != cfg.grpo.task and os.environ.get("RANK", "0") == "0":
        print(f"torchtitan_rl: no model.hf_checkpoint: seeded random weights and grpo.task_without_checkpoint "
              f"{spec!r}: a timing harness, nothing will learn (--model.hf_checkpoint DIR trains {cfg.grpo.task!r})")
    completion = max(cfg.generator.sampling.max_tokens, cfg.eval.max_tokens)
    return build_task(spec, cfg.task, tokenizer_dir=tokenizer_dir(cfg),
                      max_prompt_tokens=cfg.generator.max_model_len - completion)


def run_shape(cfg: JobConfig, task):
    """The run's model shape; the tiny flavors (vocab 0) take the task tokenizer's vocabulary."""
    from torchtitan_rl.grpo.tasks import check_vocabulary
    from torchtitan_rl.models.families import FLAVORS, resolve_shape

    flavor = FLAVORS.get(cfg.model.flavor)
    takes_task_vocab = flavor is not None and flavor.vocab_size == 0  # the tiny flavors
    shape = resolve_shape(
        flavor=cfg.model.flavor,
        hf_checkpoint=cfg.model.hf_checkpoint,
        vocab_size=cfg.model.vocab_size or (task.vocab_size if takes_task_vocab else 0),
        max_seq_len=cfg.model.max_seq_len,
    )
    check_vocabulary(
        task, spec=effective_task(cfg), model_vocab_size=shape.vocab_size, hf_checkpoint=cfg.model.hf_checkpoint
    )
    return shape


def run_device(name: str):
    """job.device as a torch.device (this rank's GPU under torchrun)."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(name)


def _reduce_mismatch(local: dict[str, float], mask_BL, device) -> dict[str, float]:
    """Mean/max/fraction over all ranks' tokens (each rank saw its own rows)."""
    import torch
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return local
    n = mask_BL.sum().item()
    sums = torch.tensor(
        [local["mismatch_mean"] * n, local["mismatch_frac_tokens"] * n, n], dtype=torch.float64, device=device
    )
    peak = torch.tensor([local["mismatch_max"]], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    total = max(sums[2].item(), 1.0)
    return {
        "mismatch_mean": sums[0].item() / total,
        "mismatch_max": peak.item(),
        "mismatch_frac_tokens": sums[1].item() / total,
    }


def _tuples(state):
    """random.Random state after a JSON-like round trip: lists back to tuples."""
    return tuple(_tuples(s) for s in state) if isinstance(state, (list, tuple)) else state


if __name__ == "__main__":
    main()
