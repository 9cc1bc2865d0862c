"""What a run shows: JSONL + TensorBoard per step, a PNG plot and a summary at the end."""

import contextlib
import dataclasses
import json
import os
import threading
from pathlib import Path

from torchtitan_rl.disk import REFUSED, free_space, human, refused, write_error


@dataclasses.dataclass(kw_only=True)
class StepMetrics:
    """One training step's metrics.jsonl line: the fields in the line's key order, each dict field's
    keys in its place (``as_dict``)."""

    reward_mean: float
    """Task reward of the step's first draw (comparable across recipes: no penalty, no refills)."""
    reward_max: float
    rollout: dict[str, float]
    """Reward spread, response lengths, truncation (grpo.groups.rollout_metrics)."""
    sampling: dict[str, float]
    """Dynamic sampling's counts; {} when off."""
    train: dict[str, float]
    """Trainer.train_step's: loss, kl, clipping, gradient norm, entropy, ..."""
    mismatch: dict[str, float]
    importance: dict[str, float]
    routing: dict[str, float]
    """MoE: routing_mismatch (the fraction of tokens whose top-k experts differ between the generator's forward
    and the trainer's recompute), routing_mismatch_layers, routing_tokens; {} for a dense model."""
    partial: dict[str, float]
    """grpo.partial's carried and dropped samples; {} when off."""
    ranks: dict[str, float]
    """train_rank_balance, how evenly the data-parallel ranks' shares of the batch came out (grpo/builder.py's
    StepBatch.ranks); {} with one process."""
    memory: dict[str, float]
    """What this rank's device held at most in each phase of the step (run/memory_watch.py: the GPU's used bytes as
    nvidia-smi counts them, on CPU the process's resident memory), in GiB: mem_generate_gib (sync, generate,
    held-out evaluation), mem_recompute_gib (the batch's build: scoring and the pi_old recompute), mem_train_gib
    (from the engine's sleep, if on); against the estimate's phases, printed at the start ("memory per GPU
    (estimate)")."""
    completion_tokens: float
    """Generated this step, dynamic sampling's refills included."""
    weight_version: int
    staleness: int
    gen_tokens_per_s: float
    sync_s: float
    generate_s: float
    wait_rollouts_s: float
    """What of sync + generate was not moving weights: the trainer waiting for its rollouts (trainer idle)."""
    generator_idle_s: float
    """Seconds the generator had no batch and no sync before this step's batch (generator idle)."""
    tail: dict[str, float]
    """Where the step's generate went (engine/trace.py, EngineTrace.metrics): gen_tail_share, gen_batch_fill,
    gen_preemptions, ...; {} where no Engine.generate made the batch (a rollout server, multi-turn episodes)."""
    evaluation_s: float
    """Held-out evaluation before this step's batch (0 when not due; its own line's eval_s says the same). Not
    named eval_*: an evaluation's line is the one whose keys start so."""
    build_s: float
    """Rollouts -> this rank's batch (grpo/builder.py): scoring, advantages, packing and the logprob recompute."""
    recompute_s: float
    """The logprob recompute of pi_old (and the reference's), part of build_s (generator.stream_groups: the groups
    recomputed while others still generated are in generate_s instead)."""
    train_s: float
    step_s: float
    log_s: float
    """The previous step's logging: its metrics line, TensorBoard scalars, progress bar (after its step_s)."""
    checkpoint_s: float
    """The previous step's checkpoint (after its step_s; 0 when none was due): writing it, and in an asynchronous
    layout first waiting for the rollouts in flight, which it keeps (rollout/queue.py)."""

    def as_dict(self) -> dict[str, float]:
        flat: dict[str, float] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            flat.update(value if isinstance(value, dict) else {field.name: value})
        return flat


TIMING_SHARES = frozenset({"gen_tail_share", "gen_batch_fill", "gen_engine_balance"})
"""Shares of a generate's wall time (engine/trace.py): timings, though their names do not end in _s."""


def is_measured(key: str) -> bool:
    """Whether a metrics.jsonl key is a measurement of the machine (a timing, a memory reading), which two runs of
    one seed need not share (all else they do)."""
    return key.endswith("_s") or key in TIMING_SHARES or (key.startswith("mem_") and key.endswith("_gib"))


class MetricsLogger:
    """Writes metrics.jsonl and TensorBoard events under the output folder (rank 0 only).

    metrics.jsonl holds one line per step and one per held-out evaluation
    (the latter's keys start with ``eval_``). A resumed run (``resume_step``
    K) keeps the lines of steps before K in metrics.jsonl and samples.jsonl,
    drops the rest (logged by steps the crash lost, or by the final evaluation,
    which run again), and its history, plot and summary cover the whole run;
    TensorBoard hides the dropped steps (``purge_step``).
    """

    def __init__(self, output_dir: Path, *, enabled: bool, resume_step: int | None = None) -> None:
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        self.history: list[dict] = []
        self.eval_history: list[dict] = []
        self._wandb = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            path = self.output_dir / "metrics.jsonl"
            with self._refusals(path, doing="opening the run's metrics"):
                self.output_dir.mkdir(parents=True, exist_ok=True)
                if resume_step is not None:
                    for record in _keep_before(path, resume_step):
                        is_eval = any(key.startswith("eval_") for key in record)
                        (self.eval_history if is_eval else self.history).append(record)
                    _keep_before(self.output_dir / "samples.jsonl", resume_step)
                # Unbuffered: a write the disk refuses is cut back to the last whole line, and no buffer is left
                # to fail again when the file is closed.
                self._jsonl = open(path, "ab", buffering=0)
                self._tb = SummaryWriter(str(self.output_dir / "tensorboard"), purge_step=resume_step)
            if threading.excepthook is not _quiet_event_writer:
                _quiet_event_writer.previous = threading.excepthook
                threading.excepthook = _quiet_event_writer

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._write(step, metrics, self.history, tb_key=lambda key: key)

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """A held-out evaluation of the weights after ``step`` optimizer steps: its own JSONL line
        (keys eval_*), TensorBoard under eval/."""
        self._write(step, metrics, self.eval_history, tb_key=lambda key: f"eval/{key.removeprefix('eval_')}")

    def _write(self, step: int, metrics: dict[str, float], history: list[dict], *, tb_key) -> None:
        record = {"step": step, **metrics}
        history.append(record)
        if not self.enabled:
            return
        path = self.output_dir / "metrics.jsonl"
        with self._refusals(path, doing=f"writing step {step}'s metrics"):
            _append_whole(self._jsonl, (json.dumps(record) + "\n").encode())
            for key, value in metrics.items():
                self._tb.add_scalar(tb_key(key), value, step)
        if self._wandb is not None:
            self._wandb.log({tb_key(key): value for key, value in metrics.items()}, step=step)

    @contextlib.contextmanager
    def _refusals(self, path: Path, *, doing: str):
        """A write the file system refuses (full, read-only) as one ValueError: the lines already written are
        whole, so a --resume from the newest checkpoint keeps them and trains the rest again."""
        try:
            yield
        except OSError as e:
            why = refused(e, path)
            if why is None:
                raise
            self.enabled = False  # nothing more to write, nor to close: the file system said no
            raise write_error(path, why, doing=doing, kept="the lines written before are whole (a --resume keeps "
                              "them and trains the steps after its checkpoint again)") from None

    def log_samples(self, step: int, samples: list[dict]) -> None:
        """Sample completions of an evaluation (prompt, completion, reward, version): one line each in
        samples.jsonl, one text entry per evaluation in TensorBoard (and a table in W&B)."""
        if not self.enabled or not samples:
            return
        path = self.output_dir / "samples.jsonl"
        with self._refusals(path, doing=f"writing step {step}'s samples"), open(path, "ab", buffering=0) as f:
            _append_whole(f, "".join(json.dumps({"step": step, **sample}) + "\n" for sample in samples).encode())
        text = "\n\n".join(
            f"**{s.get('set', '')} reward {s['reward']:.2f}, weights v{s['version']}**\n\n```\n{s['prompt']}\n---\n"
            f"{s['completion']}\n```"
            for s in samples
        )
        self._tb.add_text("samples", text, step)
        if self._wandb is not None:
            columns = ["step", *samples[0]]
            table = self._wandb_module.Table(columns=columns, data=[[step, *s.values()] for s in samples])
            self._wandb.log({"samples": table}, step=step)

    def attach_wandb(self, config, *, run_config: dict | None = None, name: str = "") -> None:
        """Also log every scalar to Weights & Biases (metrics.wandb; rank 0 only). wandb is an optional
        extra (pip install 'torchtitan_rl[wandb]'); offline mode writes under output_dir/wandb."""
        if not self.enabled:
            return
        try:
            import wandb  # optional and heavy: imported only when asked for
        except ImportError:
            raise ValueError(
                "metrics.wandb.project: wandb is not installed; pip install 'torchtitan_rl[wandb]'"
            ) from None
        self._wandb_module = wandb
        self._wandb = wandb.init(
            project=config.project, entity=config.entity, mode=config.mode, name=name or None,
            dir=str(self.output_dir), config=run_config or {},
        )

    def sync(self) -> None:
        """Make every line written so far durable (before a checkpoint that counts on them)."""
        if self.enabled:
            with self._refusals(self.output_dir / "metrics.jsonl", doing="syncing the metrics before a checkpoint"):
                os.fsync(self._jsonl.fileno())

    def close(self) -> Path | None:
        """Flush and draw reward and logprob mismatch over steps; returns the PNG path."""
        if not self.enabled:
            return None
        if self._wandb is not None:
            self._wandb.finish()
        self._jsonl.close()
        with self._refusals(self.output_dir / "tensorboard", doing="closing the TensorBoard events"):
            self._tb.close()
        if not self.history:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [r["step"] for r in self.history]
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        top.plot(steps, [r["reward_mean"] for r in self.history], label="mean reward")
        for key in sorted({k for r in self.eval_history for k in r if k.startswith("eval_accuracy")} - {
                k for r in self.eval_history for k in r if k.startswith("eval_accuracy_se")}):
            name = key.partition("/")[2] or "held-out"
            top.plot([r["step"] for r in self.eval_history if key in r], [r[key] for r in self.eval_history if key in r],
                     marker="o", label=f"{name} accuracy (greedy)")
        top.set_ylabel("reward")
        top.legend()
        bottom.plot(steps, [r["mismatch_mean"] for r in self.history], label="mean |Δ logprob|")
        bottom.plot(steps, [r["mismatch_max"] for r in self.history], label="max |Δ logprob|")
        bottom.set_yscale("symlog", linthresh=1e-4)
        bottom.set_xlabel("step")
        bottom.set_ylabel("trainer vs generator")
        bottom.legend()
        fig.tight_layout()
        path = self.output_dir / "reward_and_mismatch.png"
        try:
            fig.savefig(path, dpi=100)
        except OSError as e:  # the run's metrics are all written: the plot is a view of them
            if refused(e, path) is None:
                raise
            path.unlink(missing_ok=True)
            print(f"torchtitan_rl: {path}: not drawn, {refused(e, path)} ({human(free_space(path))} free there); "
                  f"the metrics it shows are in {self.output_dir / 'metrics.jsonl'}")
            return None
        finally:
            plt.close(fig)
        return path


def _keep_before(path: Path, step: int) -> list[dict]:
    """Rewrite the JSONL file ``path`` (if any) with its records of steps before ``step``, atomically; returns them."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line a kill cut short: its step is trained again
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] < step:
            kept.append(record)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.writelines(json.dumps(record) + "\n" for record in kept)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        tmp.unlink(missing_ok=True)  # path is as it was
        raise
    os.replace(tmp, path)
    return kept


def _quiet_event_writer(args) -> None:
    """threading.excepthook: TensorBoard's writer thread dies silently when the file system refuses its write;
    its event writer raises the same error on the main thread's next add_scalar, which says it in one line."""
    if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError) and \
            args.exc_value.errno in REFUSED:
        return
    _quiet_event_writer.previous(args)


def _append_whole(f, data: bytes) -> None:
    """Append ``data`` to the unbuffered file ``f``, or nothing: a write the file system cut short is truncated
    back, so the file never ends in half a line."""
    start = f.seek(0, os.SEEK_END)
    try:
        done = 0
        while done < len(data):
            done += f.write(data[done:])
    except OSError:
        os.truncate(f.fileno(), start)
        raise
