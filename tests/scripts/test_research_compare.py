"""scripts/gpu/research_compare.sh status reads real run folders (run-N/ and the latest link)."""

import os
import subprocess
from pathlib import Path

import pytest

from tests.test_simple_grpo import _chat_config, train
from torchtitan_rl.config import EvalSetConfig

REPO = Path(__file__).resolve().parents[2]
WORD_PROBLEMS = REPO / "torchtitan_rl" / "grpo" / "tasks" / "data" / "word_problems_eval.jsonl"


@pytest.mark.slow  # a 2-step run with its engine: ~40 s
def test_status_tables_a_two_step_run_and_copies_its_metrics(tmp_path, smollm2_dir):
    runs = tmp_path / "research"
    cfg = _chat_config(runs / "default", smollm2_dir, steps=2)  # cpu_tiny on SmolLM2's tokenizer
    cfg.model.max_seq_len = cfg.generator.max_model_len = 160
    cfg.eval.every_n_steps = 1
    cfg.eval.sets = (EvalSetConfig(name="word_problems", path=str(WORD_PROBLEMS), num_prompts=4, max_tokens=8),)
    train(cfg)
    assert (runs / "default" / "latest").is_symlink()  # what the script used to miss: runs write run-N/

    env = {**os.environ, "RUNS": str(runs), "NAMES": "default gspo", "OUT": str(tmp_path / "out"),
           "PATH": os.environ["PATH"]}
    proc = subprocess.run(["bash", str(REPO / "scripts/gpu/research_compare.sh"), "status"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split(" | ")[0].lstrip("| "): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    header = rows["run"].split(" | ")
    assert header[2:5] == ["held-out @ 0", "held-out @ 1", "held-out @ 2"]
    assert header[5:8] == ["word_problems @ 0", "word_problems @ 1", "word_problems @ 2"]
    default = rows["default"].split(" | ")
    assert default[1] == "2"  # steps trained
    assert all(c.startswith("0.000 ± 0.000") for c in default[2:8])  # the random model answers nothing
    assert "no metrics yet" in rows["gspo"]
    assert (tmp_path / "out" / "default" / "metrics.jsonl").read_text() == (
        runs / "default" / "latest" / "metrics.jsonl").read_text()
    assert (tmp_path / "out" / "table.md").read_text().strip() == "\n".join(
        line for line in proc.stdout.splitlines() if line.startswith("|"))
