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
    assert cells[1] == "NVIDIA H200 x4"  # no .machine file beside these rows: the --device given
    assert cells[2] in ("eager", "CUDA graphs") and int(cells[3]) >= 2 and cells[-1] == "ok"
    tokens, layers = (float(x) for x in cells[8].split(" / "))
    assert 0 <= layers <= tokens <= 1  # a token differs in some layer whenever a (token, layer) pair differs
    assert any(line.startswith("| Qwen3-30B-A3B shape, 1 GPU") and "not run" in line for line in lines)


def test_each_row_names_its_machine_and_a_row_without_its_folder_is_shown_as_printed():
    proc = subprocess.run([sys.executable, str(TABLE), str(RESULTS), "--device", "?"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = {c[0]: c for c in ([x.strip() for x in line.split("|")[1:-1]] for line in proc.stdout.splitlines()
                              if line.startswith("| debugmodel") or line.startswith("| Qwen3"))}
    assert all(len(cells) == 11 for cells in rows.values())
    one = rows["debugmodel_moe, 1 GPU"]
    assert one[1:3] == ["NVIDIA H200 x4", "CUDA graphs"] and one[-1] == "ok"
    ep = rows["debugmodel_moe, 2 GPUs, expert parallel 2 (FSDP)"]  # a run folder from 2 H200s
    assert ep[1] == "NVIDIA H200 x2" and int(ep[3]) == 10 and ep[-1] == "ok"
    # a3b_4gpu: its folder did not come back; the row is the device's own line, said so
    printed = [c.strip() for c in (RESULTS / "a3b_4gpu_row.txt").read_text().split("|")[2:-1]]
    lost = rows["Qwen3-30B-A3B shape, 4 GPUs (FSDP, offload, engine asleep)"]
    assert lost[1] == "NVIDIA H200 x4" and lost[2:-1] == printed[:-1] and lost[-1] == "ok: printed, no run folder"
    assert rows["Qwen3-30B-A3B shape, 1 GPU (offload, engine asleep)"][-1] == "not run"
