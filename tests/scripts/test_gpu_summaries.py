"""The GPU scripts' parsing (scripts/gpu/summarize_run.py) on a real run folder written by the loop on CPU.

The layout and size tables are made on a lent GPU machine from what this parser reads; a run folder layout
change (run-N/, latest) that it missed would leave the tables silently empty, as it once did.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_cli

REPO = Path(__file__).resolve().parents[2]
SUMMARIZE = REPO / "scripts" / "gpu" / "summarize_run.py"

pytestmark = pytest.mark.slow  # a real CPU run in the fixture: ~11 s


@pytest.fixture(scope="module")
def output_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("layout")
    proc = run_cli("--config", "run_configs/cpu_tiny.toml", "--trainer.steps", "4", "--job.output_dir", str(out),
                   "--grpo.prompts_per_step", "8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def summarize(*args: str) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, str(SUMMARIZE), *args], capture_output=True, text=True, cwd=REPO,
                          timeout=60)
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def test_summary_reads_the_newest_run_through_latest(output_dir, tmp_path):
    mem = tmp_path / "mem.csv"
    mem.write_text("0, 1000\n1, 2000\n0, 3000\n2, 9999\n1, 15")  # GPU 2 is another run's; a cut last line
    rc, line = summarize(str(output_dir), "--name", "every2", "--gpus", "0,1", "--mem", str(mem), "--engines", "2",
                         "--window", "1", "3", "--extra", "steps=4")
    assert rc == 0, line
    assert line["metrics"] == str(output_dir / "latest" / "metrics.jsonl")
    assert line["steps_logged"] == 4 and line["steps_in_window"] == 3
    medians = line["median_steps_1_3"]
    assert set(medians) >= {"step_s", "generate_s", "train_s", "sync_s", "gen_tokens_per_s", "gen_tail_share",
                            "gen_batch_fill", "gen_preemptions", "gen_kv_read_tb_per_s"}
    assert all(v >= 0 for v in medians.values()) and medians["step_s"] > 0
    assert line["tokens_per_s_per_engine"] == pytest.approx(medians["gen_tokens_per_s"] / 2)
    assert line["peak_gpu_mem_gib"] == {"0": round(3000 / 1024, 1), "1": round(2000 / 1024, 1)}
    assert set(line["peak_phase_mem_gib"]) == {"generate", "recompute", "train"}  # the loop's readings, by phase
    assert all(v > 0 for v in line["peak_phase_mem_gib"].values())
    assert line["steps"] == "4" and "problem" not in line


def test_summary_of_a_run_folder_itself_and_of_nothing(output_dir, tmp_path):
    run_folder = (output_dir / "latest").resolve()
    assert run_folder.name.startswith("run-")
    rc, line = summarize(str(run_folder), "--name", "single", "--window", "0", "3")
    assert rc == 0 and line["steps_in_window"] == 4
    rc, line = summarize(str(tmp_path / "never_ran"), "--name", "single", "--rc", "124")
    assert rc == 1 and line["steps_logged"] == 0 and "no metrics.jsonl" in line["problem"]
