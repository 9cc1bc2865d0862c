"""scripts/gpu/grpo_loop.py (run_all.sh's `grpo` call) on CPU: its step breakdown from a real run of the loop, with
gen_drift.py's per-generate diagnostics.

It once timed the recompute by wrapping a Trainer method the batch builder had stopped calling, and failed its own
check after the run (found by running it here); this test runs it end to end on cpu_tiny."""

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, repo_env

pytestmark = pytest.mark.slow  # a real CPU run: ~15 s


def test_the_breakdown_counts_each_part_once_and_names_the_peak(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/gpu/grpo_loop.py", "--config", "run_configs/cpu_tiny.toml",
                           "--steps", "3", "--skip", "1", "--out", str(tmp_path), "--no-write", "--diagnose",
                           "--grpo.prompts_per_step", "8"], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env=repo_env())  # this tree's package, not an installed one
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "grpo_summary.json").read_text())
    assert [s["step"] for s in summary["per_step"]] == [0, 1, 2]
    for step in summary["per_step"]:  # "other" is the step less the parts: none of them counted twice
        assert step["other"] >= 0, step
        assert step["trainer logprob recompute (fwd)"] > 0 and step["optimizer (AdamW, fp32)"] > 0, step
    assert 0 < summary["peak_gpu_mem_gib"] < 24  # on CPU the process's resident memory, read by the loop
    assert (tmp_path / "grpo_metrics.jsonl").exists()
    # --diagnose: scripts/gpu/gen_drift.py's hooks in vLLM's engine record every generate
    assert len(summary["generate_diagnostics"]) >= 3 and all(d["rss_gib"] > 0 for d in summary["generate_diagnostics"])
