"""The first lines an entry script runs: until its own signal handling stands, a signal ends it with one line; and
torch's CUDA allocator setting, before torch is imported.

Importing torch takes seconds, and a Ctrl-C meanwhile used to print a KeyboardInterrupt traceback. Nothing here
imports more than ``os`` and ``signal`` (already loaded by Python itself), so the handler is in place a few
milliseconds after the interpreter starts.
"""

import os
import signal

CUDA_ALLOC_CONF = "expandable_segments:True"
"""torch's CUDA caching allocator setting a training process starts with where PYTORCH_CUDA_ALLOC_CONF is unset (as
torchtitan's launcher sets it): segments that grow and shrink in place, where the default caches blocks by size and
the micro-batches' changing lengths (long samples, token-budgeted micro-batches) leave gigabytes of them reserved
and unused (docs/benchmarks.md, "The long tail (cuda)"). vLLM turns it off inside its sleep-mode pool."""


def allocator_defaults() -> str:
    """PYTORCH_CUDA_ALLOC_CONF as CUDA_ALLOC_CONF unless the environment sets it (an empty value keeps torch's own
    allocator settings): called before torch is imported, which reads it once; processes started after (torchrun's
    ranks, vLLM's engine) inherit it. Returns the setting in force."""
    return os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)


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
