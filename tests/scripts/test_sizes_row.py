"""scripts/gpu/sizes.sh's row summary (scripts/gpu/sizes_row.py), run as the script runs it, on real run output."""

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, load_script, run_module

ROW = REPO / "scripts" / "gpu" / "sizes_row.py"
SMI = "0, 1200\n1, 800\n0, 30500\n1, 900\n0, 2100\n"
"""nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits samples."""
BLOCK = 128
"""Tokens of one of vLLM's CPU KV-cache blocks."""


def _row(tmp_path, out_dir, log_text: str, rc: int, row: str) -> dict:
    (tmp_path / "run.log").write_text(log_text)
    (tmp_path / "run.mem").write_text(SMI)
    proc = subprocess.run(
        [sys.executable, str(ROW), "--output-dir", str(out_dir), "--log", str(tmp_path / "run.log"),
         "--mem", str(tmp_path / "run.mem"), "--row", row, "--exit-code", str(rc), "--first", "0", "--last", "1", "--vocab-size", "16"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_finished_run_gives_step_medians_memory_peaks_and_mfu(tmp_path):
    out_dir = tmp_path / "out"
    proc = run_module("torchtitan_rl.simple_grpo", "--config", "run_configs/cpu_tiny.toml", "--trainer.steps", "2",
                      "--job.output_dir", str(out_dir), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # capped.py's memory held beyond the cap (an 80 GB row on a bigger card) is not the run's: left out of its peaks
    held = load_script("scripts/gpu/capped.py").said(0, 140 << 30, 800 << 20, int(79.2 * (1 << 30)))
    got = _row(tmp_path, out_dir, held + "\n" + proc.stdout + proc.stderr, 0, "tiny:a:off")
    metrics = [json.loads(line) for line in (out_dir / "latest" / "metrics.jsonl").read_text().splitlines()]
    assert got["fits"] and got["steps_logged"] == 2 and got["refusal"] is None
    assert got["median"]["step_s"] == pytest.approx((metrics[0]["step_s"] + metrics[1]["step_s"]) / 2)
    assert set(got["median"]) >= {"generate_s", "train_s", "sync_s"}
    assert got["peak_gpu_mem_mib"] == {"0": 30500 - 800, "1": 900 - 800} and got["held_mib"] == 800
    assert got["estimate"].startswith("torchtitan_rl: memory per rank")
    # The engine holds the KV cache the estimate counts, less vLLM's rounding down to whole blocks.
    kv = got["kv_tokens"]
    assert kv["estimate"] - BLOCK < kv["engine"] <= kv["estimate"], kv
    assert 0 < got["trainer_mfu"] < 1e-3  # a CPU against an H100's peak


@pytest.mark.slow  # a whole process's imports and start-up: 6-8 s, out of the quick loop
def test_a_refused_run_gives_its_one_line(tmp_path):
    out_dir = tmp_path / "out"
    proc = run_module("torchtitan_rl.simple_grpo", "--config", "run_configs/cpu_tiny.toml", "--model.flavor", "8B",
                      "--job.output_dir", str(out_dir))
    assert proc.returncode == 2
    got = _row(tmp_path, out_dir, proc.stdout + proc.stderr, 2, "8B:a:off")
    assert not got["fits"] and got["steps_logged"] == 0 and got["median"] == {}
    assert got["refusal"].startswith("torchtitan_rl: error: memory: this run needs at least 183.")
    assert got["held_mib"] == 0 and got["peak_gpu_mem_mib"] == {"0": 30500, "1": 900}  # not capped
