"""scripts/check_bitwise_identity.py on the small CPU config: batch-invariant mode is bitwise."""

import subprocess
import sys

import pytest

from tests.helpers import REPO, repo_env


@pytest.mark.slow
def test_check_bitwise_identity_passes_on_the_cpu_config(tmp_path):
    proc = subprocess.run(
        # 48 new tokens: the generator's steps pad keys to 16..64 while the trainer
        # pads each batch to its longest sequence, so rows meet different paddings.
        [sys.executable, "scripts/check_bitwise_identity.py", "--config", "run_configs/cpu_tiny.toml",
         "--max-tokens", "48", "--output-dir", str(tmp_path)],
        cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| batch-invariant")]
    assert len(rows) >= 3  # several batch sizes
    for mode, batch, compared, different, max_diff in (map(str.strip, r) for r in rows):
        assert int(compared) > 0 and int(different) == 0 and float(max_diff) == 0.0
    # Default mode is not bitwise on this machine: the check can tell the two apart.
    defaults = [line for line in proc.stdout.splitlines() if line.startswith("| default")]
    assert any(int(line.split("|")[4]) > 0 for line in defaults)
    assert "PASS" in proc.stdout
