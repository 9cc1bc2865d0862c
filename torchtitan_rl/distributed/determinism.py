"""Determinism flags for the trainer's compute: process-wide settings and a scope of strict kernels."""

import contextlib
import os

import torch


def set_determinism(device: torch.device) -> None:
    """Process-wide settings that deterministic kernels need."""
    # Deterministic mode would fill every torch.empty with NaN: time, no gain here.
    torch.utils.deterministic.fill_uninitialized_memory = False
    if device.type == "cuda":
        # Read when cuBLAS initialises: effective only before the first CUDA matmul.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


@contextlib.contextmanager
def deterministic_algorithms():
    """Strict deterministic kernels around the trainer's compute, restored after.

    Strict, not warn_only: under warn_only torch 2.11 keeps SDPA's cuDNN and
    flash backward on their non-deterministic algorithms (it only warns).
    Scoped, not process-wide: a colocated vLLM engine runs ops that have no
    deterministic kernel and would raise.
    """
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
