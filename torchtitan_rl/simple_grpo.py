"""GRPO, end to end: python -m torchtitan_rl.simple_grpo --config run_configs/cpu_tiny.toml

Each step: sync -> generate -> score -> advantages -> recompute logprobs -> loss + optimizer step -> log.
Every rank runs this file (torchrun for more than one); weight_sync.transport picks where the generator
runs (docs/design.md, "The loop's layouts"), and the step body is the same for all. Heavy imports stay
inside ``train`` so that --help and config errors are instant.
"""

from torchtitan_rl.run.startup import allocator_defaults, starting_up

if __name__ == "__main__":  # a Ctrl-C while the modules import is one line, not a KeyboardInterrupt traceback
    starting_up()

import functools  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from torchtitan_rl import collector  # noqa: E402
from torchtitan_rl.run.exits import RankExits, end_when_done, one_line_errors, stamp_exit_time  # noqa: E402
from torchtitan_rl.config import JobConfig, parse_args, to_toml, write_toml  # noqa: E402
from torchtitan_rl.config.validation import effective_task, redacted_dict  # noqa: E402
from torchtitan_rl.disk import refused, release, reserve, write_error  # noqa: E402

DRY_RUN_TOML = "dry-run.toml"
"""What --dry-run writes into job.output_dir: the resolved config."""


def main(argv: list[str] | None = None) -> None:
    allocator_defaults()  # torch is not imported yet (train imports it)
    cfg = parse_args(argv)  # exits 2 with one "config error: ..." line on bad input
    if cfg.dry_run:  # not config.toml: a folder holding one is a run folder to --resume (run/folder.py, run_to_resume)
        path = Path(cfg.job.output_dir) / DRY_RUN_TOML
        with one_line_errors():
            try:
                write_toml(cfg, path)
            except OSError as e:
                if (why := refused(e, path)) is None:
                    raise
                raise write_error(path, why, doing="writing the resolved config", kept="the config is valid; "
                                  "pick a --job.output_dir you can write") from None
        print(f"torchtitan_rl: config valid; written to {path}")
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: a signal or a failure ends every rank at once
        exits = RankExits()
        try:
            train(cfg)
        except BaseException as e:  # noqa: BLE001  one line for the job, then os._exit: no rank waits on another
            exits.fail(e, traceback_dir=Path(cfg.job.output_dir))
        exits.done()
    else:
        with one_line_errors():  # user errors found past parsing: a checkpoint, a task, mismatched weights
            try:
                train(cfg)
            except BaseException:
                _destroy_process_group()  # one process: no peer waits; left to teardown gloo's threads can abort
                raise
    # After a successful run only (after a failure some ranks may still be inside a collective); left to
    # interpreter teardown, gloo's worker threads can abort a finished rank (docs/design.md).
    stamp_exit_time("trained")
    _destroy_process_group()


def _destroy_process_group() -> None:
    # Not imported here: a Ctrl-C inside torch's own import leaves it half made, and importing it again raises.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "is_initialized", lambda: False)():
        dist.destroy_process_group()


def train(cfg: JobConfig) -> list[dict]:
    """Train; returns the metrics of the steps this call trained (rank 0 has them all; the generator rank none)."""
    with collector.paused():  # start-up: the heap only grows while torch, torchtitan and vLLM import
        import torch.distributed as dist
        from tqdm import tqdm

        from torchtitan_rl.config import validate
        from torchtitan_rl.distributed.process_group import init_process_group, local_device
        from torchtitan_rl.distributed.threads import set_host_threads
        from torchtitan_rl.distributed.world import init_world
        from torchtitan_rl.engine.engine import check_sleep
        from torchtitan_rl.export import SNAPSHOT, export_size, snapshot
        from torchtitan_rl.grpo.builder import BatchBuilder
        from torchtitan_rl.grpo.eval_sets import load_eval_sets
        from torchtitan_rl.grpo.evaluate import Evaluator
        from torchtitan_rl.run.fit import fit_this_rank
        from torchtitan_rl.run.parts import run_device, run_shape, run_task
        from torchtitan_rl.run.memory import one_line_oom
        from torchtitan_rl.run.memory_watch import PhasePeaks
        from torchtitan_rl.run.metrics import MetricsLogger, StepMetrics
        from torchtitan_rl.rollout.queue import RolloutQueue
        from torchtitan_rl.serving.own_rank import serve
        from torchtitan_rl.run.folder import publish, starting
        from torchtitan_rl.run.plan import agree
        from torchtitan_rl.trainer import Trainer

    started = time.perf_counter()
    device = run_device(cfg.job.device)  # first: a CUDA config on a CPU machine says so before anything loads
    # parse_args checked the config against torchrun's world; train(cfg) may come from Python.
    validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")), device=device.type)
    set_host_threads(cfg.job.host_threads, device_type=device.type)  # before the trainer's and vLLM's pools start
    check_sleep(cfg.generator.sleep, device.type)  # here, not after minutes of trainer build
    task = run_task(cfg)
    shape = run_shape(cfg, task)
    fitted = fit_this_rank(cfg, shape, device=device)  # before the process group: cpu_offload picks its backends
    if fitted.line and int(os.environ.get("RANK", "0")) == 0:
        print(f"torchtitan_rl: {fitted.line}", flush=True)
    cfg = fitted.config
    evaluator = None
    if cfg.eval.every_n_steps:  # every set file read now: a bad one stops the run before its folder exists
        evaluator = Evaluator(cfg.eval, task=task, spec=effective_task(cfg), sampling=cfg.generator.sampling,
                              seed=cfg.job.seed, max_total_tokens=cfg.generator.max_model_len,
                              samples=cfg.metrics.samples_per_eval, sets=load_eval_sets(cfg))
    world = None
    if cfg.job.export_dir is not None:
        from torchtitan_rl.export import check_target

        check_target(cfg.job.export_dir)  # before agree(): a user error leaves no new run folder behind
    if cfg.model.hf_checkpoint is not None:
        from torchtitan_rl.models.hf_folder import check_weights

        check_weights(cfg.model.hf_checkpoint, field="model.hf_checkpoint")  # also before agree()
    if cfg.weight_sync.transport == "nccl":
        # Before the Trainer, which then takes the trainer ranks' default group; the last R ranks generate.
        world = init_world(device.type, replicas=cfg.generator.parallelism.data_parallel_replicate_degree,
                           timeout_s=cfg.trainer.collective_timeout_s,
                           weight_timeout_s=cfg.weight_sync.peer_timeout_s)
        if world.role == "generator":
            _memory_check(fitted.estimate, device=device, show=True)
            plan = agree(cfg, store=world.store, generator=True)
            with one_line_oom("the generator rank"):
                serve(cfg, world=world, shape=shape, workdir=plan.folder)
            return []
    else:
        init_process_group(device, timeout_s=cfg.trainer.collective_timeout_s,  # the Trainer reuses it
                           cpu_tensors=cfg.trainer.cpu_offload)
    _memory_check(fitted.estimate, device=device, show=dist.get_rank() == 0)
    # This run's folder (a new run-N, or the resumed run's) and the checkpoint it resumes from: rank 0 decides.
    plan = agree(cfg, store=world.store if world else None)
    out = plan.folder
    export_dir = out / "hf" if cfg.job.export else None  # <run>/hf: new, or set aside
    if cfg.job.export_dir is not None:
        export_dir = Path(cfg.job.export_dir)

    def build_trainer() -> Trainer:
        return Trainer(
            cfg.trainer, model_config=cfg.model, shape=shape, seed=cfg.job.seed,
            device=device, output_dir=out, batch_invariant=cfg.batch_invariant_mode,
        )

    rank = dist.get_rank()
    generator = memory = None
    try:
        with starting(plan), collector.paused():  # a start that fails names the run folder it leaves
            with one_line_oom("the trainer's build"):
                trainer = build_trainer()
                reference = build_trainer() if cfg.grpo.kl_coef > 0 else None  # frozen initial policy
            assert cfg.grpo.prompts_per_step * cfg.grpo.group_size % trainer.dp_size == 0, "validate checks rows"
            if rank == 0:
                try:
                    write_toml(cfg, out / "config.toml")
                    snapshot(out, cfg=cfg, task=task, shape=shape)  # what the export needs, whatever moves later
                except OSError as e:
                    if (why := refused(e, out)) is None:
                        raise
                    raise write_error(out, why, doing="writing its config.toml and export_files",
                                      kept="nothing trained") from None
                print(f"torchtitan_rl: run folder {out}")
            with one_line_oom("the generator's start"):
                generator = _generator(cfg, trainer=trainer, world=world, shape=shape, device=device, workdir=out,
                                       kv_cache_bytes=fitted.estimate.kv_bytes)
            queue = RolloutQueue(cfg, generator=generator, task=task)
            start = 0
            if plan.checkpoint is not None:
                queue.load_state_dict(trainer.load_checkpoint(plan.checkpoint), step=trainer.step)
                start = trainer.step
            builder = BatchBuilder(cfg, task=task, trainer=trainer, reference=reference, device=device)
            if export_dir is not None and rank == 0:  # the export's room, held until it is written
                reserve(export_dir, export_size(shape, dtype=cfg.model.dtype, files=out / SNAPSHOT),
                        kept="nothing trained; free space there or pick another --job.export_dir")
        if rank == 0:
            publish(out)  # everything stands: --resume now continues this run
        # A resume keeps the history before its step and drops what the lost steps logged: each step once.
        logger = MetricsLogger(out, enabled=rank == 0, resume_step=start if plan.checkpoint else None)
        earlier = len(logger.history)
        if cfg.metrics.wandb.project is not None:
            logger.attach_wandb(cfg.metrics.wandb, run_config=redacted_dict(cfg), name=cfg.job.name)
        bar = tqdm(range(start, cfg.trainer.steps), disable=rank != 0, desc=cfg.job.name, dynamic_ncols=True)
        log_s = checkpoint_s = 0.0
        memory = PhasePeaks(local_device(device))  # what each phase held, beside the estimate printed above
        for step in bar:
            t_step = time.perf_counter()
            memory.start("generate")
            # 1. sync: the generator serves the trainer's current weights to the requests made from
            #    now on (negative control: only this process's first sync, so it keeps step-0 weights, or a
            #    resumed run the checkpoint's: the engine is new and holds no others).
            sync_s = 0.0
            if cfg.weight_sync.enable or step == start:
                sync_s = generator.sync(trainer.sync_state(), version=step)
            # 2. generate: this step's rollouts, requested grpo.max_staleness steps ago (0: just now)
            with one_line_oom(f"step {step}'s generation"):
                prompts, rollouts = queue.next(step, prefetch=builder.prefetch)  # early groups' pi_old, if streamed
            wait_s = time.perf_counter() - t_step - sync_s
            # held-out accuracy of the weights just synced; the training samples above are already drawn
            t_eval = time.perf_counter()
            if evaluator and evaluator.due(step):  # a resumed run evaluates where an uninterrupted one does
                logger.log_eval(step, evaluator.run(generator, step=step))
                logger.log_samples(step, evaluator.samples)
            # 3-5. score, advantages, this rank's rows with pi_old recomputed
            t_build = time.perf_counter()
            memory.start("recompute")
            batch = builder.build(prompts, rollouts, refill=functools.partial(queue.refill, step), version=step)
            # 6. clipped policy-gradient steps: grpo.epochs x grpo.mini_batches, all against pi_old
            t_train = time.perf_counter()
            if cfg.generator.sleep != "off":  # the engine's memory goes to the trainer until the next sync
                generator.sleep()
            memory.start("train")  # after the sleep, as the estimate's train phase
            with one_line_oom(f"step {step}'s train step"):
                train = trainer.train_step(batch.train, temperature=cfg.generator.sampling.temperature,
                                           grpo=cfg.grpo, max_tokens=cfg.generator.sampling.max_tokens)
            if cfg.generator.sleep != "off":  # the engine wakes at the next sync: give it the gradients' room
                trainer.release_gradients()
            builder.measured_in_training(batch, train)  # grpo.old_logprobs train: the gap its forward measured
            train_s = time.perf_counter() - t_train
            build_s = t_train - t_build
            # 7. log
            rewards_B = batch.drawn.task_rewards_B
            completion_tokens = rollouts.generated_tokens()  # generated for the first draw
            record = StepMetrics(
                reward_mean=rewards_B.mean().item(), reward_max=rewards_B.max().item(),
                rollout=batch.rollout_stats, sampling=batch.sampling_stats, train=train,
                mismatch=batch.mismatch, importance=batch.importance, routing=batch.routing,
                partial=queue.partial_stats, ranks=batch.ranks, memory=memory.take(),
                completion_tokens=completion_tokens + batch.sampling_stats.get("refill_completion_tokens", 0.0),
                weight_version=rollouts.weight_version, staleness=step - rollouts.weight_version,
                gen_tokens_per_s=completion_tokens / max(rollouts.generate_s, 1e-9), sync_s=sync_s,
                generate_s=rollouts.generate_s, wait_rollouts_s=wait_s, generator_idle_s=rollouts.idle_s,
                tail=rollouts.trace.metrics() if rollouts.trace is not None else {},
                evaluation_s=t_build - t_eval, build_s=build_s, recompute_s=batch.recompute_s, train_s=train_s,
                step_s=time.perf_counter() - t_step, log_s=log_s, checkpoint_s=checkpoint_s,
            )
            t_log = time.perf_counter()
            logger.log(step, record.as_dict())
            bar.set_postfix(
                reward=f"{record.reward_mean:.3f}", loss=f"{train['loss']:.4f}", kl=f"{train['kl']:.4f}",
                mismatch=f"{record.mismatch['mismatch_mean']:.1e}", tok_s=f"{record.gen_tokens_per_s:.0f}",
            )
            log_s = time.perf_counter() - t_log
            # 8. checkpoint, after the step's metrics line is on disk: a resume from it never lacks a line
            checkpoint_s = 0.0
            if cfg.trainer.checkpoint.enable and (step + 1) % cfg.trainer.checkpoint.interval == 0:
                t_checkpoint = time.perf_counter()
                logger.sync()
                trainer.save_checkpoint(step + 1, extra=queue.state_dict(),
                                        files={"config.toml": to_toml(cfg)})  # what a resume compares its config with
                checkpoint_s = time.perf_counter() - t_checkpoint

        # Also for a resume of a finished run (start == steps): its final evaluation's line was dropped above.
        plot = _finish(cfg, evaluator=evaluator, generator=generator, trainer=trainer, logger=logger, shape=shape,
                       run=out, export_dir=export_dir)
        generator.close()  # before the last line: the command ends right after it (run.exits.end_when_done)
        generator = None
        if rank == 0 and logger.history:
            _print_summary(cfg, logger, start=start, wall_s=time.perf_counter() - started, plot=plot)
        return logger.history[earlier:]  # this call's steps (history holds the whole run)
    finally:
        if memory is not None:
            memory.close()
        if generator is not None:
            generator.close()
        if export_dir is not None and rank == 0:
            release(export_dir)  # a run that ended before its export: the room it held


def _memory_check(est, *, device, show: bool) -> None:
    """Print what this rank's GPU will hold (``est``: its role's estimate, run/fit.py); on CUDA refuse, in one line,
    a run whose certain part cannot fit."""
    import torch

    from torchtitan_rl.distributed.process_group import local_device
    from torchtitan_rl.run.memory import check_fits, host_available

    device = local_device(device)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else host_available()
    if show:
        print(f"torchtitan_rl: {est.summary()}", flush=True)
    # On CPU every rank of this host shares its memory.
    check_fits(est, free=free if est.device_total else free // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
               device=str(device))


def _generator(cfg: JobConfig, *, trainer, world, shape, device, workdir: Path, kv_cache_bytes: int):
    """The generator as the loop sees it, in every layout (rollout/base.py): sync, submit, close. A colocated engine
    gets ``kv_cache_bytes`` (the memory estimate's) for its KV cache."""
    from torchtitan_rl.rollout.colocated import ColocatedGenerator
    from torchtitan_rl.rollout.remote import RemoteGenerator
    from torchtitan_rl.rollout.server_client import ServerGenerator

    if cfg.weight_sync.transport == "server":
        return ServerGenerator(cfg, reference=trainer.sync_state(), device=device)
    if world is None:
        return ColocatedGenerator(cfg, reference=trainer.sync_state(), shape=shape, device=device, workdir=workdir,
                                  kv_cache_bytes=kv_cache_bytes)
    return RemoteGenerator(cfg, reference=trainer.sync_state(), world=world)


def _finish(cfg: JobConfig, *, evaluator, generator, trainer, logger, shape, run: Path, export_dir) -> Path | None:
    """After the last step: held-out accuracy of the trained weights, the export and the plot (its path)."""
    if evaluator:
        final_evaluation(cfg, evaluator, generator, trainer, logger)
    if export_dir is not None:  # every trainer rank: sharded tensors are gathered
        from torchtitan_rl.export import SNAPSHOT, export_hf, weights_left

        export_hf(trainer.sync_state(), shape=shape, out_dir=export_dir,
                  tokenizer_dir=run / SNAPSHOT, hf_checkpoint=run / SNAPSHOT, lora=cfg.model.lora,
                  dtype=cfg.model.dtype, kept=lambda: weights_left(run, cfg))
    return logger.close()


def _print_summary(cfg: JobConfig, logger, *, start: int, wall_s: float, plot) -> None:
    """One line: reward (and held-out accuracy) at the start and the end of the whole run."""
    history = logger.history
    k = max(1, min(5, len(history) // 4))
    first = sum(r["reward_mean"] for r in history[:k]) / k
    last = sum(r["reward_mean"] for r in history[-k:]) / k
    held_out = ""
    if logger.eval_history:
        a, b = logger.eval_history[0], logger.eval_history[-1]
        for key in (k for k in a if k.startswith("eval_accuracy") and not k.startswith("eval_accuracy_se")):
            name = f"{key.partition('/')[2]} accuracy" if "/" in key else "held-out accuracy"
            if key in b:
                held_out += f"{name} {a[key]:.3f} (step {a['step']}) -> {b[key]:.3f} (step {b['step']}); "
    print(
        f"torchtitan_rl: {held_out}mean reward {first:.3f} (first {k} steps) -> {last:.3f} (last {k} steps); "
        f"steps {history[0]['step']}..{history[-1]['step']}{f' (resumed at {start})' if start else ''}; "
        f"wall {wall_s:.1f} s; metrics {logger.output_dir / 'metrics.jsonl'}; plot {plot}"
    )


def final_evaluation(cfg: JobConfig, evaluator, generator, trainer, logger) -> None:
    """Held-out accuracy of the trained weights (one more sync: no step generated with them)."""
    version = cfg.trainer.steps
    if cfg.weight_sync.enable:  # the negative control's generator keeps serving step-0 weights
        generator.sync(trainer.sync_state(), version=version)
    logger.log_eval(version, evaluator.run(generator, step=version))
    logger.log_samples(version, evaluator.samples)


def cli() -> None:
    """The command (``python -m torchtitan_rl.simple_grpo``): ``main``, then the process ends at once (tests and
    scripts call ``main`` in their own process)."""
    end_when_done(main)


if __name__ == "__main__":
    cli()
