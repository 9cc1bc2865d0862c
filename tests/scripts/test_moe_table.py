"""scripts/gpu/moe_table.py: issue 40's section of docs/benchmarks.md from moe.sh's run folders (the committed
GPU results under scripts/gpu/results/moe, real run folders: the first lease's under eager_onecore/)."""

import subprocess
import sys

from tests.helpers import REPO

TABLE = REPO / "scripts" / "gpu" / "moe_table.py"
RESULTS = REPO / "scripts" / "gpu" / "results" / "moe"


def test_rows_from_real_run_folders_and_the_next_section_kept(tmp_path):
    doc = tmp_path / "benchmarks.md"
    marker = "<!-- Weight sync, MoE (cuda) -->\n## Weight sync, MoE (cuda)\nkept\n<!-- /Weight sync, MoE (cuda) -->\n"
    doc.write_text("# Benchmarks\n\n<!-- Mixture of experts (cuda) -->\n## Mixture of experts (cuda)\n\nold table\n"
                   "<!-- /Mixture of experts (cuda) -->\n" + marker)
    for _ in range(2):  # a second write replaces the section, never the one after it
        proc = subprocess.run([sys.executable, str(TABLE), str(RESULTS / "eager_onecore"), "--device",
                               "NVIDIA H200 x4", "--write", str(doc)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
    text = doc.read_text()
    assert "old table" not in text and text.count("## Mixture of experts (cuda)") == 1
    assert marker in text
    lines = text.splitlines()
    a3b = next(line for line in lines if line.startswith("| Qwen3-30B-A3B shape, 4 GPUs"))
    cells = [c.strip() for c in a3b.split("|")[1:-1]]
    assert cells[1] in ("eager", "CUDA graphs") and int(cells[2]) >= 2 and cells[-1] == "ok"
    tokens, layers = (float(x) for x in cells[7].split(" / "))
    assert 0 <= layers <= tokens <= 1  # a token differs in some layer whenever a (token, layer) pair differs
    assert any(line.startswith("| Qwen3-30B-A3B shape, 1 GPU") and "not run" in line for line in lines)


def test_a_row_without_metrics_shows_its_note_and_graph_rows_say_so():
    proc = subprocess.run([sys.executable, str(TABLE), str(RESULTS), "--device", "NVIDIA H200 x4"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = {c[0]: c for c in ([x.strip() for x in line.split("|")[1:-1]] for line in proc.stdout.splitlines()
                              if line.startswith("| debugmodel") or line.startswith("| Qwen3"))}
    assert rows["debugmodel_moe, 1 GPU"][1] == "CUDA graphs" and rows["debugmodel_moe, 1 GPU"][-1] == "ok"
    lost = rows["Qwen3-30B-A3B shape, 4 GPUs (FSDP, offload, engine asleep)"]
    assert lost[2] == "0" and lost[-1] == (RESULTS / "a3b_4gpu.note").read_text().strip()
