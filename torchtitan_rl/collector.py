"""Python's cycle collector paused where its full passes only cost time: a process's start-up and a generate.

While a process imports torch, vLLM and transformers and builds its trainer and engine, its heap only grows, and
every automatic full pass walks all of it again to find almost nothing (docs/benchmarks.md, "Start-up: the cycle
collector paused"); during a generate vLLM's per-token objects set it off the same way. Refcounting still frees
everything acyclic at once; the few cycles made meanwhile wait for the next collection, and the libraries'
own explicit ``gc.collect()`` calls (vLLM's, before it measures free memory) still run.
"""

import contextlib
import gc


@contextlib.contextmanager
def paused():
    """The collector off for the block, back on after if it was on before (so these nest)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
