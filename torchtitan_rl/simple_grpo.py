"""GRPO, end to end: python -m torchtitan_rl.simple_grpo --config run_configs/cpu_tiny.toml

Each step: sync -> generate -> score -> advantages -> recompute logprobs ->
loss + optimizer step -> log. Every rank runs this file (torchrun for more
than one). Where the vLLM generator runs is weight_sync.transport:
"inplace", in trainer rank 0's process (generator/colocated.py); "nccl", on
the last torchrun rank(s), each its own device (generator/remote.py; R
replicas split each batch), the other ranks train; "server", a rollout server (python -m torchtitan_rl.serve) over
HTTP (generator/server_client.py). The step body is the same for all three
(generator/base.py is all it knows of them). With grpo.max_staleness = S > 0
the rollouts of step k are requested S steps early, right after that step's
sync, so the generator samples them while the trainer learns; each batch is
then up to S weight versions old. Heavy imports stay inside ``run`` so that
--help and config errors are instant.
"""

import functools
import os
import time
from collections import deque
from pathlib import Path

from torchtitan_rl.cli import RankExits, one_line_errors
from torchtitan_rl.config import JobConfig, parse_args, to_toml, write_toml
from torchtitan_rl.config.loader import effective_task, redacted_dict, tokenizer_dir


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)  # exits 2 with one "config error: ..." line on bad input
    if cfg.dry_run:
        write_toml(cfg, Path(cfg.job.output_dir) / "config.toml")
        print(f"torchtitan_rl: config valid; written to {Path(cfg.job.output_dir) / 'config.toml'}")
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: a signal or a failure ends every rank at once
        exits = RankExits()
        try:
            run(cfg)
        except BaseException as e:  # noqa: BLE001  one line for the job, then os._exit: no rank waits on another
            exits.fail(e, traceback_dir=Path(cfg.job.output_dir))
        exits.done()
    else:
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
    """Train; returns the metrics of the steps this call trained (rank 0 has them all; the generator rank none)."""
    import random

    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from torchtitan_rl.config import validate
    from torchtitan_rl.rollout.base import Done, RolloutGenerator
    from torchtitan_rl.rollout.colocated import ColocatedGenerator
    from torchtitan_rl.rollout.remote import RemoteGenerator, serve
    from torchtitan_rl.rollout.server_client import ServerGenerator
    from torchtitan_rl.grpo import group_advantages
    from torchtitan_rl.grpo.batch import logprob_mismatch, pack_rollouts
    from torchtitan_rl.grpo.loss import importance_weights
    from torchtitan_rl.grpo.evaluate import Evaluator
    from torchtitan_rl.job import run_device, run_shape, run_task
    from torchtitan_rl.grpo.groups import REFILL_SEED_OFFSET, fill_with_signal, rollout_metrics, score_groups
    from torchtitan_rl.metrics import MetricsLogger
    from torchtitan_rl.runs import agree
    from torchtitan_rl.trainer import Trainer
    from torchtitan_rl.distributed.process_group import init_process_group
    from torchtitan_rl.trainer.trainer import TrainBatch
    from torchtitan_rl.distributed.world import init_world

    started = time.perf_counter()
    device = run_device(cfg.job.device)  # first: a CUDA config on a CPU machine says so before anything loads
    task = run_task(cfg)
    shape = run_shape(cfg, task)
    world = None
    if cfg.weight_sync.transport == "nccl":
        # parse_args checked this layout against torchrun's world; run(cfg) may come from Python.
        validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        # Before the Trainer, which then takes the trainer ranks' default group; the last R ranks generate.
        world = init_world(device.type, replicas=cfg.generator.parallelism.data_parallel_replicate_degree,
                           timeout_s=cfg.trainer.collective_timeout_s)
        if world.role == "generator":
            plan = agree(cfg, store=world.store, generator=True)
            serve(cfg, world=world, shape=shape, workdir=plan.folder)
            return []
    else:
        init_process_group(device)  # the Trainer reuses it
    # This run's folder (a new run-N, or the resumed run's) and the checkpoint it resumes from: rank 0 decides.
    plan = agree(cfg, store=world.store if world else None)
    out = plan.folder
    export_dir = cfg.job.export_dir or (out / "hf" if cfg.job.export else None)
    if export_dir is not None:
        from torchtitan_rl.export import check_target

        check_target(export_dir)  # before training, not after it

    def build_trainer() -> Trainer:
        return Trainer(
            cfg.trainer, model_config=cfg.model, shape=shape, seed=cfg.job.seed,
            device=device, output_dir=out, batch_invariant=cfg.batch_invariant_mode,
        )

    evaluator = None
    if cfg.eval.every_n_steps:
        evaluator = Evaluator(cfg.eval, task=task, spec=effective_task(cfg), sampling=cfg.generator.sampling,
                              seed=cfg.job.seed, max_total_tokens=cfg.generator.max_model_len,
                              samples=cfg.metrics.samples_per_eval)
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
        print(f"torchtitan_rl: run folder {out}")
    generator: RolloutGenerator | None = None
    try:
        # The generator as the loop sees it, in every layout: sync, submit/rollouts, close.
        if cfg.weight_sync.transport == "server":
            generator = ServerGenerator(cfg, reference=trainer.sync_state(), device=device)
        elif world is None:
            generator = ColocatedGenerator(cfg, reference=trainer.sync_state(), shape=shape, device=device, workdir=out)
        else:
            generator = RemoteGenerator(cfg, reference=trainer.sync_state(), world=world)

        prompt_rng = random.Random(cfg.job.seed)
        start = 0
        queued = []  # (step, prompts, Rollouts) a checkpoint saved: requested before it, not trained on yet
        if plan.checkpoint is not None:
            extra = trainer.load_checkpoint(plan.checkpoint)
            prompt_rng.setstate(_tuples(extra["prompt_rng"]))
            task.load_state_dict(extra.get("task", {}))  # a dataset's place in its epoch
            start = trainer.step
            queued = extra.get("queued", [])
            _check_queued(cfg, queued)

        # Requests in flight, oldest first: (step, prompts, Pending). Prompts and seeds are drawn in
        # step order, so step k trains on the same prompts whatever grpo.max_staleness.
        S = cfg.grpo.max_staleness
        inflight = deque((j, prompts, Done(r)) for j, prompts, r in queued)
        requested = start + len(inflight)  # the next step to request rollouts for
        temperature = cfg.generator.sampling.temperature
        truncated = cfg.generator.sampling.top_p < 1 or cfg.generator.sampling.top_k != -1
        max_tokens = cfg.generator.sampling.max_tokens
        # A resume keeps the history before its step and drops what the lost steps logged: each step once.
        logger = MetricsLogger(out, enabled=rank == 0, resume_step=start if plan.checkpoint else None)
        earlier = len(logger.history)
        if cfg.metrics.wandb.project is not None:
            logger.attach_wandb(cfg.metrics.wandb, run_config=redacted_dict(cfg), name=cfg.job.name)
        scored = functools.partial(  # (prompts, rollouts) -> Groups: rewards, overlong penalty, cut flags
            score_groups, task, group_size=G, max_tokens=max_tokens, overlong=cfg.grpo.overlong,
            overlong_buffer=cfg.grpo.overlong_buffer, overlong_penalty_at_max=cfg.grpo.overlong_penalty, device=device,
        )
        bar = tqdm(range(start, cfg.trainer.steps), disable=rank != 0, desc=cfg.job.name, dynamic_ncols=True)
        for step in bar:
            t_step = time.perf_counter()
            # 1. sync: the generator serves the trainer's current weights to the requests made from
            #    now on (negative control: only the first sync, so it keeps step-0 weights).
            sync_s = 0.0
            if cfg.weight_sync.enable or step == start:
                sync_s = generator.sync(trainer.sync_state(), version=step)

            # 2. generate: request rollouts up to S steps ahead (the generator serves them with the
            #    weights just synced, while the trainer learns), then take this step's, requested
            #    S steps ago (S = 0: just now). Every rank gets the rollouts.
            while requested <= min(step + S, cfg.trainer.steps - 1):
                ask = task.sample_prompts(P, generator=prompt_rng)
                inflight.append((requested, ask, task.submit(  # a multi-turn task plays whole episodes
                    generator, ask, n=G, seed=cfg.job.seed * 1_000_003 + requested,
                    sampling=cfg.generator.sampling, max_total_tokens=cfg.generator.max_model_len,
                )))
                requested += 1
            _, prompts, pending = inflight.popleft()
            rollouts = pending.result()
            wait_s = time.perf_counter() - t_step - sync_s  # what of phases 1-2 was not moving weights
            staleness = step - rollouts.weight_version  # > S only in the no-sync control
            assert staleness <= S or not cfg.weight_sync.enable, (step, rollouts.weight_version, S)
            # held-out accuracy of the weights just synced; the training samples above are already drawn
            if evaluator and evaluator.due(step, first=0):  # a resumed run evaluates where an uninterrupted one does
                logger.log_eval(step, evaluator.run(generator, step=step))
                logger.log_samples(step, evaluator.samples)

            # 3. score: each rank a share, gathered (every rank trains on the same rewards); DAPO's
            #    dynamic sampling replaces groups without signal by fresh ones, sampled now
            def refill(round_):  # its own RNG per (seed, step, round): the step's prompts do not depend on S
                more = task.sample_prompts(P, generator=random.Random(f"refill:{cfg.job.seed}:{step}:{round_}"))
                return scored(more, task.rollouts(
                    generator, more, n=G, seed=REFILL_SEED_OFFSET * round_ + cfg.job.seed * 1_000_003 + step,
                    sampling=cfg.generator.sampling, max_total_tokens=cfg.generator.max_model_len,
                ))

            drawn = scored(prompts, rollouts)
            signals = rollout_metrics(drawn)  # the step's first sample, before any filtering
            batch, sampling_stats = drawn, {}
            if cfg.grpo.dynamic_sampling:
                batch, sampling_stats = fill_with_signal(
                    drawn, refill, want=P, max_rounds=cfg.grpo.dynamic_sampling_max_rounds
                )
            rewards_B = drawn.task_rewards_B  # logged: the task's reward of the first draw, comparable across recipes
            # 4. group-relative advantages
            advantages_B = group_advantages(batch.rewards_B, group_size=G, norm=cfg.grpo.advantage_norm)

            # 5. this rank's rows; the trainer recomputes their logprobs
            tokens_BL, mask_BL, gen_lp_BL = pack_rollouts(
                batch.prompt_ids, batch.completion_ids, batch.logprobs, pad_id=task.pad_id,
                loss_mask=batch.loss_mask,
            )
            if cfg.grpo.overlong == "mask":  # DAPO's overlong filtering: cut completions leave the loss
                if batch.truncated_B.all():  # nothing would be left to score: the same zero policy gradient
                    advantages_B = torch.zeros_like(advantages_B)
                else:
                    mask_BL[batch.truncated_B] = 0
            # Tensor-parallel peers share a data shard: split over data-parallel ranks only.
            per_rank = P * G // trainer.dp_size
            rows = slice(trainer.dp_rank * per_rank, (trainer.dp_rank + 1) * per_rank)
            trainer_lp_BL = trainer.token_logprobs(tokens_BL[rows], temperature=temperature, mask_BL=mask_BL[rows]).cpu()
            mismatch = _reduce_token_stats(
                logprob_mismatch(trainer_lp_BL, gen_lp_BL[rows], mask_BL[rows]), mask_BL[rows], device
            )
            if truncated:  # the generator's logprobs are the truncated distribution's: no sync signal
                mismatch = dict.fromkeys(mismatch, float("nan"))
            # off-policy weight pi_old / mu of each token, capped (None: grpo.importance_correction off)
            is_weights_BL, is_stats = importance_weights(
                trainer_lp_BL, gen_lp_BL[rows], mask_BL[rows],
                mode=cfg.grpo.importance_correction, cap=cfg.grpo.importance_cap,
            )
            is_stats = _reduce_token_stats(is_stats, mask_BL[rows], device)
            ref_lp_BL = (
                reference.token_logprobs(tokens_BL[rows], temperature=temperature, mask_BL=mask_BL[rows]).cpu()
                if reference else None
            )

            # 6. clipped policy-gradient steps: grpo.epochs x grpo.mini_batches, all against pi_old above
            t_train = time.perf_counter()
            metrics = trainer.train_step(
                TrainBatch(tokens_BL[rows], mask_BL[rows], trainer_lp_BL, advantages_B[rows], ref_lp_BL,
                           is_weights_BL),
                temperature=temperature, grpo=cfg.grpo, max_tokens=max_tokens,
            )
            train_s = time.perf_counter() - t_train

            # 7. log
            completion_tokens = sum(len(c) for c in rollouts.completion_ids)  # generated for the first draw
            record = {
                "reward_mean": rewards_B.mean().item(),
                "reward_max": rewards_B.max().item(),
                **signals,
                **sampling_stats,
                **metrics,
                **mismatch,
                **is_stats,
                "completion_tokens": completion_tokens + sampling_stats.get("refill_completion_tokens", 0.0),
                "weight_version": rollouts.weight_version,
                "staleness": staleness,
                "gen_tokens_per_s": completion_tokens / max(rollouts.generate_s, 1e-9),
                "sync_s": sync_s,
                "generate_s": rollouts.generate_s,
                "wait_rollouts_s": wait_s,
                "generator_idle_s": rollouts.idle_s,
                "train_s": train_s,
                "step_s": time.perf_counter() - t_step,
            }
            logger.log(step, record)
            bar.set_postfix(
                reward=f"{record['reward_mean']:.3f}", loss=f"{record['loss']:.4f}", kl=f"{record['kl']:.4f}",
                mismatch=f"{record['mismatch_mean']:.1e}", tok_s=f"{record['gen_tokens_per_s']:.0f}",
            )

            # 8. checkpoint, after the step's metrics line is on disk: a resume from it never lacks a line
            if cfg.trainer.checkpoint.enable and (step + 1) % cfg.trainer.checkpoint.interval == 0:
                logger.sync()
                # Rollouts requested for later steps go with it (waited for): the weights they were
                # sampled with are gone, so they could not be drawn again.
                queued = [(j, prompts_j, pending_j.result()) for j, prompts_j, pending_j in inflight]
                trainer.save_checkpoint(step + 1, extra={
                    "prompt_rng": prompt_rng.getstate(), "task": task.state_dict(), "queued": queued,
                }, files={"config.toml": to_toml(cfg)})  # what a resume compares its config with

        if evaluator and start < cfg.trainer.steps:
            final_evaluation(cfg, evaluator, generator, trainer, logger)
        if export_dir is not None:  # every trainer rank: sharded tensors are gathered
            from torchtitan_rl.export import export_hf

            export_hf(trainer.sync_state(), shape=shape, out_dir=export_dir,
                      tokenizer_dir=tokenizer_dir(cfg), lora=cfg.model.lora, dtype=cfg.model.dtype)
        plot = logger.close()
        history = logger.history  # the whole run, steps before a resume included
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
                f"steps {history[0]['step']}..{cfg.trainer.steps}{f' (resumed at {start})' if start else ''}; "
                f"wall {time.perf_counter() - started:.1f} s; "
                f"metrics {out / 'metrics.jsonl'}; plot {plot}"
            )
        return history[earlier:]  # this call's steps
    finally:
        if generator is not None:
            generator.close()


def final_evaluation(cfg: JobConfig, evaluator, generator, trainer, logger) -> None:
    """Held-out accuracy of the trained weights (one more sync: no step generated with them)."""
    version = cfg.trainer.steps
    if cfg.weight_sync.enable:  # the negative control's generator keeps serving step-0 weights
        generator.sync(trainer.sync_state(), version=version)
    logger.log_eval(version, evaluator.run(generator, step=version))
    logger.log_samples(version, evaluator.samples)


def _reduce_token_stats(local: dict[str, float], mask_BL, device) -> dict[str, float]:
    """Per-token statistics of this rank's rows over all ranks' tokens: keys ending in _max by max,
    the others (means, fractions) weighted by each rank's token count."""
    import torch
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return local
    n = mask_BL.sum().item()
    means = [k for k in local if not k.endswith("_max")]
    peaks = [k for k in local if k.endswith("_max")]
    sums = torch.tensor([local[k] * n for k in means] + [n], dtype=torch.float64, device=device)
    peak = torch.tensor([local[k] for k in peaks], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    total = max(sums[-1].item(), 1.0)
    reduced = {**{k: s / total for k, s in zip(means, sums.tolist())}, **dict(zip(peaks, peak.tolist()))}
    return {k: reduced[k] for k in local}  # the caller's key order


def _check_queued(cfg: JobConfig, queued: list) -> None:
    """Rollouts a checkpoint queued must fit this run's staleness bound (they cannot be drawn again)."""
    S = cfg.grpo.max_staleness
    too_old = [(j, r.weight_version) for j, _, r in queued if j - r.weight_version > S]
    if too_old and cfg.weight_sync.enable:
        raise ValueError(
            f"grpo.max_staleness: the checkpoint holds rollouts for steps {[j for j, _ in too_old]} sampled with "
            f"weight versions {[v for _, v in too_old]}, older than max_staleness {S} allows; resume with the "
            "grpo.max_staleness the run was saved with"
        )


def _tuples(state):
    """random.Random state after a JSON-like round trip: lists back to tuples."""
    return tuple(_tuples(s) for s in state) if isinstance(state, (list, tuple)) else state


if __name__ == "__main__":
    main()
