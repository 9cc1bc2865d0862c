"""scripts/gpu/research_compare.sh and research_table.py on a real run folder (run-N/, latest, an export),
and research_table.py on its research.tgz unpacked (one folder per lease).

The comparison's tables are made on a lent GPU machine from what these parse; a layout change the parser
missed would leave them silently empty, as the first version did (it read <name>/metrics.jsonl, while runs
write run-N/).
"""

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.test_simple_grpo import _chat_config, train
from torchtitan_rl.config import EvalSetConfig

REPO = Path(__file__).resolve().parents[2]
WORD_PROBLEMS = REPO / "torchtitan_rl" / "grpo" / "tasks" / "data" / "word_problems_eval.jsonl"
SCRIPT = REPO / "scripts" / "gpu" / "research_compare.sh"


def _rows(table: str, header: str) -> dict[str, list[str]]:
    """The markdown table under the line ``header``: first cell (+ seed) -> cells."""
    lines = table[table.index(header):].splitlines()[4:]  # past the title, a blank, the head and its rule
    rows = {}
    for line in lines:
        if not line.startswith("| "):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        rows[f"{cells[0]}/{cells[1]}"] = cells
    return rows


@pytest.mark.slow  # a 2-step run with its engine, its export scored by the evaluator: ~90 s
def test_wait_scores_the_export_and_packs_tables_that_read_the_run(tmp_path, smollm2_dir):
    runs = tmp_path / "research"
    cfg = _chat_config(runs / "default_s0", smollm2_dir, steps=2)  # the tiny model on SmolLM2's tokenizer
    cfg.model.max_seq_len = cfg.generator.max_model_len = 160
    cfg.eval.every_n_steps, cfg.metrics.samples_per_eval, cfg.job.export = 1, 8, True
    cfg.eval.sets = (EvalSetConfig(name="word_problems", path=str(WORD_PROBLEMS), num_prompts=4, max_tokens=8),)
    train(cfg)
    assert (runs / "default_s0" / "latest").is_symlink()
    (runs / "default_s0.args").write_text("(launched by the test)")
    (runs / "default_s0.gpu").write_text("0")
    (runs / "gspo_s1").mkdir()  # launched, no metrics yet
    (runs / "long_default").symlink_to(runs / "default_s0")  # parsed as a long run
    (runs / "calculator_s0").symlink_to(runs / "default_s0")  # and as a tool-task run
    for name in ("long_default", "calculator_s0"):  # launched too: wait scores their exports
        (runs / f"{name}.args").write_text("(launched by the test)")
        (runs / f"{name}.gpu").write_text("0")

    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "RUNS": str(runs), "OUT": str(out), "MAX_RESTARTS": "0"}
    proc = subprocess.run(["bash", str(SCRIPT), "wait", "0"], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The evaluator scored the run's export with the run's settings, as the loop's final evaluation did.
    report = json.loads((runs / "eval_default_s0.json").read_text())
    assert set(report["sets"]) == {"heldout", "word_problems"}

    table = (out / "table.md").read_text()
    held = _rows(table, "Greedy accuracy ± standard error, held-out (task's split):")
    header = next(line for line in table.splitlines() if line.startswith("| run | seed | steps"))
    assert [c.strip() for c in header.strip("|").split(" | ")][3:6] == ["@0", "@1", "@2"]
    default = held["default (token mean, 1 step a batch)/0"]
    assert default[2] == "2" and all(c.startswith("0.000 ± 0.000") for c in default[3:6])  # random weights
    assert "no metrics yet" in held["GSPO (seq ratio, clip 3e-4 / 4e-4)/1"]
    words = _rows(table, "Greedy accuracy ± standard error, word_problems:")
    assert words["default (token mean, 1 step a batch)/0"][3:6] == ["0.000 ± 0.000"] * 3
    training = _rows(table, "Training over the run")["default (token mean, 1 step a batch)/0"]
    assert training[-1] == "equal"  # the export, scored by python -m torchtitan_rl.evaluate
    assert "Best preset (final held-out accuracy, the runs so far): default" in table
    assert "Not run yet: GRPO seed 0, Dr. GRPO seed 0, DAPO seed 0, GSPO seed 0, default seed 1, GRPO seed 1," in table
    long = _rows(table, "long_default (2 steps trained):")
    assert list(long) == ["before step 0/0.000 ± 0.000", "0-1/0.000 ± 0.000"]
    assert long["0-1/0.000 ± 0.000"][4] == "0.000"  # right answers (correct_frac) beside the reward
    tool = _rows(table, "calculator_s0 (2 steps trained):")
    assert list(tool) == ["before step 0/0.000 ± 0.000", "0-1/0.000 ± 0.000"]
    assert "calculator" not in table[:table.index("Best preset")]  # not a preset of the comparison
    # the long and the tool-task run's exports, scored like the comparison's
    assert table.count("Export scored by the standalone evaluator: equal.") == 2

    # The sections for docs/benchmarks.md, and every run's raw files in one tarball.
    bench = (out / "benchmarks.md").read_text()
    for section in ("GRPO recipes on SmolLM2 math (cuda)", "GRPO long run on SmolLM2 math (cuda)",
                    "Multi-turn tool task after the fixes (cuda)"):
        assert bench.count(f"<!-- {section} -->") == bench.count(f"<!-- /{section} -->") == 1
    with tarfile.open(out / "research.tgz") as tgz:
        names = set(tgz.getnames())
        tgz.extractall(tmp_path / "unpacked", filter="data")
    assert {"./default_s0/metrics.jsonl", "./default_s0/samples.jsonl", "./default_s0/config.toml",
            "./default_s0/evaluate.json"} <= names
    assert sorted(p.name for p in out.iterdir()) == ["benchmarks.md", "research.tgz", "table.md"]

    # Here, from the tarball: the same tables (the run that wrote nothing is not in it).
    again = subprocess.run([sys.executable, "scripts/gpu/research_table.py", "--runs", str(tmp_path / "unpacked")],
                           capture_output=True, text=True, cwd=REPO)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [line for line in table.splitlines() if "no metrics yet" not in line]
    # Two leases' tarballs unpacked side by side: a run of the second replaces the first's (a cut-short
    # default_s0 there), and the runs of each are read.
    lease1, lease2 = tmp_path / "lease1", tmp_path / "lease2"
    shutil.copytree(tmp_path / "unpacked", lease1)
    lease2.mkdir()
    for name in ("default_s0", "calculator_s0"):
        shutil.move(lease1 / name, lease2 / name)
    shutil.copytree(lease2 / "default_s0", lease1 / "default_s0")
    metrics = lease1 / "default_s0" / "metrics.jsonl"
    metrics.write_text(metrics.read_text().splitlines()[0] + "\n")
    both = subprocess.run([sys.executable, "scripts/gpu/research_table.py", "--runs", str(lease1), str(lease2)],
                          capture_output=True, text=True, cwd=REPO)
    assert both.returncode == 0, both.stderr
    assert both.stdout == again.stdout
    # A run cut right after an evaluation (a lost lease's): step 0 and the evaluation after it, no final one.
    cut = lease1 / "grpo_s0"
    shutil.copytree(lease2 / "default_s0", cut)
    lines = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    (cut / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines if r["step"] < 1 or (
        r["step"] == 1 and "eval_accuracy" in r)))
    partial = subprocess.run([sys.executable, "scripts/gpu/research_table.py", "--runs", str(lease1), str(lease2)],
                             capture_output=True, text=True, cwd=REPO).stdout
    assert "Not finished (no final evaluation): GRPO seed 0 (1 of 2 steps)." in partial
    assert _rows(partial, "Training over the run")["GRPO (seq-mean, k3 KL 0.04)/0"][-1] == "-"  # no export check
    assert "Best preset (final held-out accuracy, the runs so far): default" in partial
    best = subprocess.run([sys.executable, "scripts/gpu/research_table.py", "--runs", str(runs), "--best"],
                          capture_output=True, text=True, cwd=REPO)
    assert best.stdout.strip() == "default"
