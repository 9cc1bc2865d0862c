"""Stand-in for `ray`, which the GPU image lacks.

vLLM 0.26's IPC weight-transfer engine (vllm/distributed/weight_transfer/
ipc_engine.py) does `import ray` at module level but needs Ray only for its
'ray' send mode. scripts/bench_weight_sync.py uses a callable send mode, so
nothing here is ever called; calling it fails loudly.
"""


def get(*_args, **_kwargs):
    raise RuntimeError("ray is not installed on this machine (scripts/gpu/stubs/ray)")


def remote(*_args, **_kwargs):
    raise RuntimeError("ray is not installed on this machine (scripts/gpu/stubs/ray)")
