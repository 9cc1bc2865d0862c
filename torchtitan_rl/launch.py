"""Start a multi-process run as torchrun does, and end it as this package's commands end: with one line.

    python -m torchtitan_rl.launch --nproc-per-node 3 -m torchtitan_rl.simple_grpo --config run_configs/cpu_tiny.toml

Takes torchrun's arguments and runs torchrun's own elastic agent (``torch.distributed.run.run``: the same
rendezvous, store, restarts and worker environment); on several machines, one launcher per machine with
``--nnodes`` and one ``--rdzv-endpoint`` (docs/cluster.md). What differs is the end: each machine's log ends with
one line, and no traceback. The ranks say why a job ended themselves (run.exits.RankExits: one line for the job,
the first failure, written into torchrun's store); torchrun would then add its ``SignalException`` traceback
(Ctrl-C, SIGTERM), its ``ChildFailedError`` report and traceback (any rank's exit code but 0), or a
``RendezvousError`` traceback (another machine's launcher gone). Here the launcher ends with 128 + the signal's
number, a failed rank's exit code, or 1, and says one line unless a rank of its machine said the job's line:
the job's line as its ranks learnt it (the failure came from another machine), else what it saw itself (the
signal, the lost rendezvous, a rank killed before it could say anything). A Ctrl-C while it is still importing
torch or waiting for the other machines is one line too.
"""

from torchtitan_rl.run.startup import starting_up

if __name__ == "__main__":  # torch's import takes seconds: a signal meanwhile is one line, not a traceback
    starting_up()

import logging  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from torchtitan_rl.run.exits import NODE_DIR  # noqa: E402

# The agent's store client logs each connection it loses (another machine's launcher ended) as a C++ warning with a
# native stack; what that means is this launcher's one line. Read once, when torch loads; the ranks log as usual.
_QUIET_CPP = "TORCH_CPP_LOG_LEVEL" not in os.environ
if _QUIET_CPP:
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.elastic.rendezvous.api import (  # noqa: E402
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousTimeoutError,
)
from torch.distributed.run import parse_args, run  # noqa: E402

if _QUIET_CPP:
    del os.environ["TORCH_CPP_LOG_LEVEL"]

from torchtitan_rl.distributed.threads import TORCHRUN_OMP  # noqa: E402  (imports torch: after the level is read)

SAID = "torchtitan_rl:"
"""How a rank's own line starts (run.exits.RankExits.end writes it into the rank's torchelastic error file too)."""
USER_ERROR = 2
"""A rank's exit code for a user error: rank 0 printed the line (config errors, run.plan.agree)."""


def main(argv: list[str] | None = None) -> None:
    # From here on a signal is torchrun's own SignalException, which its agent also raises once the ranks run: the
    # rendezvous (waiting for the other machines) ends as the run does.
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _raise_signal)
    node = Path(tempfile.mkdtemp(prefix="torchtitan_rl-launch-"))
    try:
        code = _launch(argv, node)
    finally:
        shutil.rmtree(node, ignore_errors=True)
    if code:
        raise SystemExit(code)


def _raise_signal(signum, frame) -> None:
    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


def _launch(argv: list[str] | None, node: Path) -> int:
    """Run torchrun's agent; the exit code, after this machine's line."""
    args = parse_args(argv)
    # The agent logs each worker it stops and each failure as WARNING/ERROR lines; the ranks' line says it. Its
    # modules' loggers carry their own level (torch.distributed.elastic.utils.logging): each is set, not the parent.
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ[NODE_DIR] = str(node)  # the ranks inherit it: torchrun passes its environment on
    if "OMP_NUM_THREADS" not in os.environ:  # the agent's 1 is not the user's: each rank takes its share
        os.environ[TORCHRUN_OMP] = "1"
    try:
        run(args)
        return 0
    except (SignalException, ChildFailedError, RendezvousError) as e:
        error = e
    for signum in (signal.SIGINT, signal.SIGTERM):  # the agent has stopped every rank: a second Ctrl-C changes nothing
        signal.signal(signum, signal.SIG_IGN)
    if isinstance(error, SignalException):  # the ranks got the signal from the agent and stopped; the launcher says it
        _node_line(node, f"torchtitan_rl: interrupted ({error.sigval.name})")
        return 128 + int(error.sigval)
    if isinstance(error, ChildFailedError):
        return _ended(error, node)
    _node_line(node, _rendezvous_failed(error, args.rdzv_endpoint or f"{args.master_addr}:{args.master_port}"))
    return 1


def _rendezvous_failed(error: RendezvousError, endpoint: str) -> str:
    """One line for a rendezvous that failed, at the start or while the ranks run."""
    if isinstance(error, RendezvousConnectionError):
        what = "lost the connection to the job's rendezvous store: the machine whose launcher held it ended or died"
    elif isinstance(error, RendezvousClosedError):
        what = "the job's rendezvous is closed: another machine's launcher ended the job"
    elif isinstance(error, RendezvousTimeoutError):
        what = ("not every machine came within torchrun's join timeout (--rdzv-conf join_timeout=SECONDS, "
                "default 600)")
    else:  # torchrun's message says what
        what = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no detail'}"
    return (f"torchtitan_rl: rendezvous at {endpoint}: {what}; this machine's ranks stopped (every machine runs "
            "the same --rdzv-endpoint and --nnodes: docs/cluster.md)")


def _node_line(node: Path, own: str | None) -> None:
    """This machine's one line: none if one of its ranks printed the job's line; else the job's line as its ranks
    learnt it from the store (the failure came from another machine); else ``own``, what the launcher saw."""
    if (node / "said").exists():
        return
    try:
        line = (node / "line").read_text()
    except OSError:
        line = own and ("\n" if (node / "open").exists() else "") + own
    if line:
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)


def _ended(error: ChildFailedError, node: Path) -> int:
    """The job's exit code, after this machine's line (one naming a rank that was killed before it could say why)."""
    failures = sorted(error.failures.items(), key=lambda item: item[1].timestamp)
    said = [f for _, f in failures if isinstance(f.message, str) and f.message.startswith(SAID)]
    if said:
        _node_line(node, None)
        return said[0].exitcode
    if any(f.exitcode == USER_ERROR for _, f in failures):
        _node_line(node, None)
        return USER_ERROR
    rank, first = failures[0]
    how = (f"was killed by {signal.Signals(-first.exitcode).name}" if first.exitcode < 0
           else f"exited with code {first.exitcode}")
    # After a newline: the killed rank may have left its progress bar's line open, and cannot say so.
    _node_line(node, f"\n{SAID} rank {rank} (pid {first.pid}) {how} before it could say why "
                     "(killed from outside, out of memory, or a crash in native code); every rank stopped")
    return 128 - first.exitcode if first.exitcode < 0 else first.exitcode


if __name__ == "__main__":
    main()
