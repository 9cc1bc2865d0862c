"""What a start continues from: a new run folder, or the run ``latest`` names resumed from its checkpoint.

``--resume`` continues the run ``latest`` points at (or ``job.output_dir``
itself when that is a run folder) from its newest checkpoint that verifies,
after checking the config against the one the checkpoint was saved with.
Rank 0 decides; every rank gets the same plan (``agree``).
"""

import os
import pickle
import shutil
from pathlib import Path

import torch.distributed as dist

from torchtitan_rl.config import JobConfig, load_toml
from torchtitan_rl.config.job_config import SECRETS
from torchtitan_rl.config.validation import config_diff
from torchtitan_rl.disk import refused, write_error
from torchtitan_rl.run.folder import LATEST, RunPlan, new_run_folder, point_latest, run_to_resume
from torchtitan_rl.trainer import checkpoint

NOT_COMPARED = ("job.output_dir", "resume", "resume_if_any", "dry_run")
"""How a run was started, not what it trains."""
FIXED = {
    "model.flavor": "the model's shape", "model.hf_checkpoint": "the model's weights and shape",
    "model.vocab_size": "the model's shape", "model.lora.rank": "the trained adapters",
    "model.lora.alpha": "the trained adapters", "model.lora.target_modules": "the trained adapters",
    "grpo.task": "the prompts and their saved position", "grpo.task_without_checkpoint": "the prompts",
    "grpo.partial.enable": "the unfinished samples its checkpoints hold, or not",
    **{f"task.{name}": "the prompts and their saved position" for name in (
        "tokenizer", "levels", "heldout_size", "path", "heldout_path", "heldout_fraction", "prompt_field",
        "answer_field")},
}
"""Fields a resume refuses to change, and what they fixed; every other field may change and takes effect."""
FIXED_WITH_QUEUED = ("grpo.prompts_per_step", "grpo.group_size", "generator.sampling.")
"""Also fixed when the run had grpo.max_staleness > 0 or grpo.partial: its checkpoint holds rollouts drawn with them."""


def plan_run(cfg: JobConfig, *, say=print) -> RunPlan:
    """Rank 0: this run's folder (a new run-N, created) or the resumed run's, with its checkpoint."""
    out = Path(cfg.job.output_dir)
    folder = Path(cfg.trainer.checkpoint.folder)
    if cfg.resume or cfg.resume_if_any:
        run, why = run_to_resume(out), f"{out} holds no run"
        if run is not None:
            found = checkpoint.newest_verified(run / folder, say=say)
            if found is not None:
                return _resume(cfg, run, *found, say=say)
            why = f"no checkpoint that verifies in {run / folder}"
        if not cfg.resume_if_any:
            raise ValueError(f"--resume: nothing to resume: {why} (start a new run without --resume, or pass "
                             "--resume-if-any to start one when there is nothing to resume)")
        say(f"torchtitan_rl: --resume-if-any: {why}; starting a new run")
    return RunPlan(new_run_folder(out))


def _resume(cfg: JobConfig, run: Path, step: int, path: Path, *, say) -> RunPlan:
    saved_config = path / "config.toml" if (path / "config.toml").is_file() else run / "config.toml"
    saved = load_toml(saved_config) if saved_config.is_file() else None
    if saved is not None:
        check_changes(saved, cfg, since=f"step-{step}", say=say)
    for moved in checkpoint.set_aside_newer(path.parent, step):
        say(f"torchtitan_rl: {moved.name}: set aside (steps after {step} are trained again)")
    if cfg.job.export and cfg.job.export_dir is None and (run / "hf").exists():  # the run ends again: a new export
        aside = run / f"hf.before-resume-at-step-{step}"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(run / "hf", aside)
        say(f"torchtitan_rl: {run / 'hf'}: set aside as {aside.name} (the resumed run exports again)")
    if (run.parent / LATEST).is_symlink() and run.parent.joinpath(LATEST).resolve() != run:
        point_latest(run)
    say(f"torchtitan_rl: resuming {run} from {path.name}{_extension_note(saved, cfg, step)}")
    return RunPlan(run, path)


def _extension_note(saved: JobConfig | None, cfg: JobConfig, step: int) -> str:
    """What the resume line adds when more steps extend an asynchronous run that had ended: its last steps
    requested no rollouts past its end, so the new steps' first rollouts are drawn with newer weights than
    a run of the new length straight through would have drawn them with (rollout/queue.py)."""
    if saved is None or saved.grpo.max_staleness == 0 or cfg.trainer.steps <= saved.trainer.steps:
        return ""
    first, last = saved.trainer.steps, min(step - 1 + saved.grpo.max_staleness, cfg.trainer.steps - 1)
    if last < first:  # a checkpoint before the end: its queue holds what a straight run would have drawn
        return ""
    return (f"; note: the run ended at step {saved.trainer.steps} and never drew the rollouts of steps "
            f"{first}..{last}: they are drawn now with the step-{step} weights, so from step {first} on this run's "
            f"samples differ from a {cfg.trainer.steps}-step run straight through (same algorithm, other draws)")


def check_changes(saved: JobConfig, cfg: JobConfig, *, since: str, say=print) -> None:
    """One line per field changed since the saved run; ValueError naming the first that cannot change."""
    queued = saved.grpo.max_staleness > 0 or saved.grpo.partial.enable
    for path, old, new in config_diff(saved, cfg):
        if path in NOT_COMPARED or path in SECRETS:  # config.toml shows secrets redacted: never compared, never printed
            continue
        fixed = FIXED.get(path)
        if fixed is None and queued and path.startswith(FIXED_WITH_QUEUED):
            fixed = "the rollouts queued in the checkpoint were drawn with it"
        if fixed is not None:
            raise ValueError(f"{path}: cannot change on resume ({fixed}): the run has {old!r}, got {new!r}; "
                             "start a new run (without --resume) to change it")
        say(f"torchtitan_rl: resume: {path} {old!r} -> {new!r} (changed since {since})")


def agree(cfg: JobConfig, *, store=None, generator: bool = False) -> RunPlan:
    """plan_run on rank 0 and the same plan, or its error, on every rank: over the default process group, and
    to generator ranks (``generator``; their group is their own) through the torchrun ``store``."""
    key = f"torchtitan_rl/run_plan/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if generator:
        result = pickle.loads(store.get(key))
    else:
        box = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = plan_run(cfg)
            except ValueError as e:
                box[0] = e
            except OSError as e:  # a read-only or full output folder: no run folder, nothing else touched
                why = refused(e, Path(cfg.job.output_dir))
                box[0] = (write_error(Path(cfg.job.output_dir), why, doing="creating the run folder",
                                      kept="nothing written") if why else ValueError(f"job.output_dir: {e}"))
            if store is not None:
                store.set(key, pickle.dumps(box[0]))
        dist.broadcast_object_list(box, src=0)
        result = box[0]
    if isinstance(result, ValueError):
        if not generator and dist.get_rank() == 0:
            raise result
        raise SystemExit(2)  # rank 0 says why
    return result
