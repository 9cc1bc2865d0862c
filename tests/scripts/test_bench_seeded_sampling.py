"""scripts/bench_seeded_sampling.py runs (on CPU here, on a GPU in the device calls) and writes its section."""

import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO, repo_env


@pytest.mark.slow  # imports vLLM: ~10 s
def test_it_times_both_ways_and_writes_its_section(tmp_path):
    work = tmp_path / "repo"
    (work / "docs").mkdir(parents=True)
    (work / "scripts").mkdir()
    for name in ("bench_seeded_sampling.py", "bench_common.py"):
        shutil.copy(REPO / "scripts" / name, work / "scripts" / name)
    proc = subprocess.run([sys.executable, "scripts/bench_seeded_sampling.py", "--device", "cpu", "--rows", "8",
                           "--vocab", "64", "--repeats", "3", "--write"], cwd=work, capture_output=True, text=True,
                          timeout=300, env=repo_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = (work / "docs" / "benchmarks.md").read_text()
    assert "## Seeded sampling, vLLM's per-request loop (cpu)" in text
    row = next(line for line in text.splitlines() if line.startswith("| 8 |"))
    host, wall = (float(x) for x in row.split("|")[3].split(" / "))
    assert 0 < host <= wall
