"""One run, one folder: ``<job.output_dir>/run-N`` and the ``latest`` link.

Each run of a config gets a new ``<job.output_dir>/run-N`` (config.toml,
metrics.jsonl, tensorboard/, the plot, checkpoints/), and the symlink
``<job.output_dir>/latest`` points at the newest that started training. So running the same command
twice keeps both runs, and a run never prunes, appends to or overwrites
another's files. What a start or a resume does with them: run/plan.py.
"""

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

LATEST = "latest"
"""Symlink in job.output_dir to the newest run folder."""
_RUN_DIR = re.compile(r"run-(\d+)")


@dataclass
class RunPlan:
    folder: Path
    """This run's folder (config, metrics, checkpoints)."""
    checkpoint: Path | None = None
    """The verified checkpoint a resume starts from; None: a new run from step 0."""


def run_to_resume(output_dir: Path) -> Path | None:
    """The run folder --resume continues: what ``latest`` points at, else output_dir itself if it is a run folder
    (it has a config.toml), else None."""
    if (output_dir / LATEST).is_dir():
        return (output_dir / LATEST).resolve()
    if (output_dir / "config.toml").is_file():
        return output_dir
    return None


def new_run_folder(output_dir: Path) -> Path:
    """Create the next run-N in output_dir. ``latest`` moves to it once the run starts training (``publish``):
    a start that fails (an engine without memory, a checkpoint that does not fit) leaves --resume on the
    previous run."""
    output_dir.mkdir(parents=True, exist_ok=True)
    n = 1 + max((int(m.group(1)) for p in output_dir.iterdir() if (m := _RUN_DIR.fullmatch(p.name))), default=0)
    while True:
        try:
            (output_dir / f"run-{n}").mkdir()
            break
        except FileExistsError:  # another run took it meanwhile
            n += 1
    return output_dir / f"run-{n}"


def publish(run: Path) -> None:
    """Point ``latest`` at ``run`` (rank 0; once the run's trainer and generator stand)."""
    if (run.parent / LATEST).resolve() != run.resolve():
        point_latest(run)


@contextmanager
def starting(plan: RunPlan) -> Iterator[None]:
    """The start of a new run (trainer, generator, batch builder; until ``publish``): a user error on the way
    removes the run folder if it is still empty, else names it and what it holds in its line; ``latest`` stays
    on the run before. What only the engine can tell (room for vLLM's KV cache) fails here, not before run-N."""
    try:
        yield
    except ValueError as e:
        if plan.checkpoint is not None or dist.is_initialized() and dist.get_rank() != 0:
            raise
        left = sorted(p.name for p in plan.folder.iterdir())
        if not left:  # nothing written yet: the run leaves no folder
            plan.folder.rmdir()
            raise
        latest = plan.folder.parent / LATEST
        before = f"--resume stays on {latest.resolve().name}" if latest.is_dir() else "no run to --resume"
        raise ValueError(f"{e} [this start left {plan.folder} holding {', '.join(left)}; {before}]") from None


def point_latest(run: Path) -> None:
    link, tmp = run.parent / LATEST, run.parent / f".{LATEST}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(run.name, tmp)
    os.replace(tmp, link)  # atomic: latest always names a whole run folder
