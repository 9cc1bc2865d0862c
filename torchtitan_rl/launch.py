"""Start a multi-process run as torchrun does, and end it as this package's commands end: with one line.

    python -m torchtitan_rl.launch --nproc-per-node 3 -m torchtitan_rl.simple_grpo --config run_configs/cpu_tiny.toml

Takes torchrun's arguments and runs torchrun's own elastic agent (``torch.distributed.run.run``: the same
rendezvous, store, restarts and worker environment). What differs is the end. The ranks say why a job
ended themselves (run.exits.RankExits: one line for the job, the signal or the first failure); torchrun then adds
its ``SignalException`` traceback (Ctrl-C, SIGTERM) or its ``ChildFailedError`` report and traceback (any
rank's exit code but 0). Here the agent's signal ends the launcher with 128 + the signal's number, and a
failed child with its exit code, silently when a rank already said why (its line is in the rank's
torchelastic error file, see RankExits.end, or it exited 2: a user error rank 0 printed); otherwise with
one line naming the rank and how it ended (a rank killed before it could say anything).
"""

import logging
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

SAID = "torchtitan_rl:"
"""How a rank's own line starts (run.exits.RankExits.end writes it into the rank's torchelastic error file too)."""
USER_ERROR = 2
"""A rank's exit code for a user error: rank 0 printed the line (config errors, run.plan.agree)."""


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # The agent logs each worker it stops and each failure as WARNING/ERROR lines; the ranks' line says it.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except SignalException as e:  # every rank said the signal's line and stopped (run.exits.RankExits)
        sys.stdout.flush()
        raise SystemExit(128 + int(e.sigval)) from None
    except ChildFailedError as e:
        raise SystemExit(_ended(e)) from None


def _ended(error: ChildFailedError) -> int:
    """The job's exit code; one line unless a rank already said why."""
    failures = sorted(error.failures.items(), key=lambda item: item[1].timestamp)
    said = [f for _, f in failures if isinstance(f.message, str) and f.message.startswith(SAID)]
    if said:
        return said[0].exitcode
    if any(f.exitcode == USER_ERROR for _, f in failures):
        return USER_ERROR
    rank, first = failures[0]
    how = (f"was killed by {signal.Signals(-first.exitcode).name}" if first.exitcode < 0
           else f"exited with code {first.exitcode}")
    # After a newline: the killed rank may have left its progress bar's line open.
    print(f"\n{SAID} rank {rank} (pid {first.pid}) {how} before it could say why "
          "(killed from outside, out of memory, or a crash in native code); every rank stopped",
          file=sys.stderr, flush=True)
    return 128 - first.exitcode if first.exitcode < 0 else first.exitcode


if __name__ == "__main__":
    main()
