"""What every command of this package does with a user's mistake, a signal, or a failed torchrun rank."""

import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from tqdm import tqdm

_KEY = "torchtitan_rl/exit"
"""Store keys of the exit protocol: the first failure's line, every rank's host and pid."""
NODE_DIR = "TORCHTITAN_RL_NODE_DIR"
"""Environment variable launch.py gives its ranks: a folder where they tell it about the job's line (``said``: a rank
of this machine printed it; ``line``: the job's line as a rank learnt it from another machine; ``open``: a rank's
progress bar may have left the last line open), so that every machine's log ends with one line."""
ORPHAN_CHECK_S = 1.0
"""How often a torchrun rank checks that its launcher (torchrun's agent) still lives."""


EXIT_TIMES = "TORCHTITAN_RL_EXIT_TIMES"
"""Environment variable a timing harness sets (scripts/gpu/mission_step.py): a JSON file where rank 0 writes the
wall-clock times of its ending (``stamp_exit_time``): ``trained`` (the run returned, before the process group's
destroy) and ``main_returned`` (just before ``os._exit``: after it, the kernel's and the driver's teardown)."""
PEER_DEATH_WAIT_S = 2.0
"""How long a failed rank looks for a dead peer to blame before it reports its own error."""

_ENDING = threading.Lock()
"""Held by the thread that ends the process: an exception and torchrun's SIGTERM can end it at once from two threads."""
_MUTING = threading.Lock()
"""Held while file descriptor 2 points at /dev/null (_native_stderr_muted)."""


def say(line: str) -> None:
    """Print the command's last line; a rank under launch.py also tells its launcher that a rank said it."""
    print(line, file=sys.stderr, flush=True)
    _tell_launcher("said", line)


def _tell_launcher(name: str, text: str) -> None:
    folder = os.environ.get(NODE_DIR)
    if folder:
        try:  # whole or absent: the launcher may read it while another rank of its node writes
            part = Path(folder) / f".{name}.{os.getpid()}"
            part.write_text(text)
            os.replace(part, Path(folder) / name)
        except OSError:
            pass


@contextmanager
def one_line_errors():
    """A ValueError (a user error: it names the field, file or tensor) ends the command with one line, exit 2;
    Ctrl-C (SIGINT) or SIGTERM with one line, exit 128 + the signal's number. The block's ``finally`` clauses
    run (an engine shuts down) before the process ends."""
    interrupt = signal.SIG_IGN if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else signal.default_int_handler
    previous = {signum: signal.signal(signum, handler) for signum, handler in (
        (signal.SIGINT, interrupt), (signal.SIGTERM, _raise_terminated))}
    try:
        yield
    except ValueError as e:
        say(f"torchtitan_rl: error: {e}")
        raise SystemExit(2) from None
    except KeyboardInterrupt as e:
        signum = signal.SIGTERM if isinstance(e, _Terminated) else signal.SIGINT
        say(f"torchtitan_rl: interrupted ({signum.name})")
        raise SystemExit(128 + signum) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def _native_stderr_muted():
    """torch's store client logs each call that fails as a C++ warning with a native stack, straight to file
    descriptor 2; an ending job may have lost its store (the machine whose launcher held it ended), and what that
    means is this rank's line."""
    with _MUTING:
        sys.stderr.flush()
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def end_when_done(main: Callable[[], None]) -> None:
    """A command's entry point: run ``main``, then end the process at once with its exit code (0, or its
    SystemExit's), flushing what it printed. The interpreter's teardown is skipped: after a run it took seconds
    (vLLM's and torch's finalizers, CUDA, inductor's compile workers, gloo's threads) while every file of the
    run was already closed (docs/design.md, "Why the code looks this way"). A bug's traceback ends it as usual."""
    code: int = 0
    try:
        main()
    except SystemExit as e:
        if isinstance(e.code, str):  # as the interpreter does with a message: said, exit 1
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    stamp_exit_time("main_returned")
    os._exit(code)


def stamp_exit_time(name: str) -> None:
    """Under a timing harness (EXIT_TIMES), rank 0 adds the wall-clock time of ``name`` to its file."""
    if (path := os.environ.get(EXIT_TIMES)) and os.environ.get("RANK", "0") == "0":
        times = json.loads(Path(path).read_text()) if Path(path).is_file() else {}
        Path(path).write_text(json.dumps({**times, name: time.time()}))


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, as Ctrl-C's KeyboardInterrupt is."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


class RankExits:
    """How one rank of a torchrun job ends: at once, and with one line for the whole job.

    A rank blocked inside a collective or a store wait runs no Python signal
    handler until that call returns (minutes, or never once a peer is gone),
    so torchrun's SIGINT/SIGTERM used to wait 30 s for its SIGKILL. Here the
    signal's C handler writes to a wakeup pipe that a thread watches; the
    thread (and, for an exception, the main thread) writes the failure's line
    into torchrun's store unless another rank wrote one first, prints it only
    then, and ends the process with ``os._exit``. A rank whose peer vanished
    (kill -9, OOM) names that rank: every rank leaves its host and pid in the
    store at start, and a pid that is gone or a zombie is the dead one.
    """

    def __init__(self) -> None:
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.store = None
        self.prefix = f"{_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.node = os.environ.get("GROUP_RANK", "0")
        """torchrun's node rank of this rank's launcher."""
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent serves it: no rank waits
            import torch.distributed as dist

            self.store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                timeout=timedelta(seconds=5),
            )
            self.store.set(f"{self.prefix}/pid/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        read, write = os.pipe()
        os.set_blocking(write, False)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)  # the thread below acts; the main thread may be stuck in C++
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read,), name="torchtitan_rl-signals", daemon=True).start()

    def _watch(self, read: int) -> None:
        launcher = os.getppid()
        agent = "TORCHELASTIC_RUN_ID" in os.environ
        while True:
            if not select.select([read], [], [], ORPHAN_CHECK_S)[0]:
                # torchrun's agent killed (kill -9 of a node's launcher): nothing else would ever stop this rank
                if agent and os.getppid() != launcher:
                    self.end(f"rank {self.rank}'s launcher (pid {launcher}) died; every rank stops", 1)
                continue
            for signum in os.read(read, 64):
                if signum in (signal.SIGINT, signal.SIGTERM):
                    name = signal.Signals(signum).name
                    dead = self.dead_peer()
                    if dead:  # torchrun's agent stopping the job for a lost rank: the job failed, as in fail()
                        self.end(f"{dead}; rank {self.rank} stopped ({name})", 1)
                    self.end(f"interrupted ({name}) at rank {self.rank}; every rank stops", 128 + signum,
                             forwarded=True)

    def fail(self, error: BaseException, *, traceback_dir: Path) -> None:
        """End this rank for an exception out of the run (a ValueError: a user error, exit 2); a bug's
        traceback goes to ``traceback_dir``/error_rank<R>.txt. SystemExit: another rank says why (run.plan.agree)."""
        if isinstance(error, SystemExit):
            self.done()  # no failure of this rank's own: no line, no traceback, not a dead peer for the others
            self._echo_first()
            sys.stdout.flush()
            os._exit(error.code if isinstance(error.code, int) else 1)
        dead = None
        if not isinstance(error, ValueError):  # a user error is this rank's own; anything else may be a lost peer's
            # A peer's sockets close before it shows as gone or a zombie; on a loaded host that takes a second.
            # Another rank's line in the store already says why (a peer on another machine, whose pid no rank here
            # can check): no need to wait.
            deadline = time.monotonic() + PEER_DEATH_WAIT_S
            while (dead := self.dead_peer()) is None and not self._said() and time.monotonic() < deadline:
                time.sleep(0.1)
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if isinstance(error, ValueError):
            line, code = f"error: rank {self.rank}: {message}", 2
        else:
            line, code = f"rank {self.rank} failed: {type(error).__name__}: {message}", 1
            if dead is None and self._store_gone():  # its socket error is the echo of another machine's end
                line = (f"rank {self.rank} lost the job: the job's store is gone too, so the machine whose launcher "
                        f"held it ended or died (its log says why); here {type(error).__name__}: {message}")
            if "Timed out" in message or "timed out" in message:
                line += " (waited trainer.collective_timeout_s for another rank)"
            try:
                path = Path(traceback_dir) / f"error_rank{self.rank}.txt"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("".join(traceback.format_exception(error)))
                line += f"; traceback in {path}"
            except OSError:
                pass
        self.end(f"{dead}; rank {self.rank} stopped" if dead else line, code)

    def done(self) -> None:
        """This rank finished its run: its exit is no failure for a peer to report."""
        if self.store is not None:
            self.store.set(f"{self.prefix}/pid/{self.rank}", "done")

    def dead_peer(self) -> str | None:
        """'rank R (pid P) died' for a rank on this host whose process is gone, if any."""
        if self.store is None:
            return None
        host = socket.gethostname()
        try:
            for r in range(self.world_size):
                key = f"{self.prefix}/pid/{r}"
                if r == self.rank or not self._ask("check", [key]):
                    continue
                value = self._ask("get", key).decode()
                if value == "done":
                    continue
                peer_host, pid = value.split()
                if peer_host == host and not _alive(int(pid)):
                    return f"rank {r} (pid {pid}) died"
        except Exception:  # noqa: BLE001  torchrun's store is gone: it is tearing the job down itself
            return None
        return None

    def _said(self) -> bool:
        """Whether a rank put the job's line in the store."""
        try:
            return self.store is not None and self._ask("check", [f"{self.prefix}/first"])
        except Exception:  # noqa: BLE001  the store is gone
            return False

    def _store_gone(self) -> bool:
        """Whether the job's store no longer answers (the launcher that held it ended)."""
        if self.store is None:
            return False
        try:
            self._ask("check", [f"{self.prefix}/first"])
        except Exception:  # noqa: BLE001  any failure of the call is the answer
            return True
        return False

    def _ask(self, op: str, *args):
        """One call of the job's store, its C++ warning muted if the store is gone (the exception is raised)."""
        with _native_stderr_muted():
            return getattr(self.store, op)(*args)

    def end(self, line: str, code: int, *, forwarded: bool = False) -> None:
        """Print ``line`` unless another rank's failure came first, then exit without waiting for anyone.
        ``forwarded``: a signal from torchrun's agent; under launch.py the launcher got it (or lost the
        rendezvous and sent it) and says the line itself."""
        # Two writers of the error file would interleave into JSON torchrun cannot read (its traceback, not our line);
        # the second thread here waits for the first one's os._exit.
        _ENDING.acquire()
        try:
            self._say(f"torchtitan_rl: {line}", forwarded=forwarded)
        finally:  # whatever saying it met (stderr closed), the process ends
            os._exit(code)

    def _say(self, line: str, *, forwarded: bool) -> None:
        mine = {"line": line, "node": self.node, "signal": forwarded}
        first = mine
        if self.store is not None:
            try:
                first = json.loads(self._ask("compare_set", f"{self.prefix}/first", "", json.dumps(mine)))
            except Exception:  # noqa: BLE001  the store is gone: say it anyway
                pass
        if first == mine and not (forwarded and os.environ.get(NODE_DIR)):
            with _MUTING:  # not into /dev/null: another thread may be asking the store
                say(self._line_start() + line)
        else:
            self._echo(first)
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:  # torchrun's agent reads it: its report (plain torchrun) or launch.py's exit code
            try:  # whole or absent: a kill mid-write would leave JSON that torchrun fails on with a traceback
                part = Path(f"{error_file}.part")
                part.write_text(json.dumps({"message": first["line"], "timestamp": int(time.time())}))
                os.replace(part, error_file)
            except OSError:
                pass
        sys.stdout.flush()

    def _line_start(self) -> str:
        """A newline if this rank's stderr may hold an unfinished line: rank 0's progress bar leaves its line open (no
        newline until it closes, and os._exit closes nothing); another rank shares rank 0's stderr but cannot see its
        bar, so it starts a line of its own."""
        return "\n" if self.rank != 0 or any(not bar.disable for bar in list(getattr(tqdm, "_instances", ()))) else ""

    def _echo_first(self) -> None:
        """Another rank says why the job ends, maybe on another node: tell this node's launcher the job's line."""
        if self.store is None or not os.environ.get(NODE_DIR):
            return
        key = f"{self.prefix}/first"
        try:
            self._ask("wait", [key], timedelta(seconds=PEER_DEATH_WAIT_S))
            first = json.loads(self._ask("get", key))
        except Exception:  # noqa: BLE001  not said within the wait, or the store is gone: the launcher says what it saw
            return
        self._echo(first)

    def _echo(self, first: dict) -> None:
        """Tell launch.py the job's line, which it prints unless a rank of its node did; not a signal that this node's
        launcher got (or sent, having lost the rendezvous): it says what it saw."""
        start = self._line_start()
        if first["node"] != self.node or not first["signal"]:
            _tell_launcher("line", start + first["line"])
        elif start:
            _tell_launcher("open", "")  # the launcher's own line starts with a newline


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")
