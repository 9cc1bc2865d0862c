"""The first line an entry script runs: until its own signal handling stands, a signal ends it with one line.

Importing torch takes seconds, and a Ctrl-C meanwhile used to print a KeyboardInterrupt traceback. Nothing here
imports more than ``os`` and ``signal`` (already loaded by Python itself), so the handler is in place a few
milliseconds after the interpreter starts.
"""

import os
import signal


def starting_up() -> None:
    """Until the command's own handling takes over (run.exits' one_line_errors or RankExits, launch.py's), SIGINT
    and SIGTERM end the process at once: it is still importing and holds nothing to clean up. One line, or none in
    a torchrun rank: its launcher got the signal too, and says it."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup, a shell's background job: stays ignored
            signal.signal(signum, _end_while_starting)


def _end_while_starting(signum, frame) -> None:
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        os.write(2, f"torchtitan_rl: interrupted ({signal.Signals(signum).name})\n".encode())  # no buffered I/O
    os._exit(128 + signum)
