"""scripts/gpu/one_gpu_table.py: issue 41's section of docs/benchmarks.md from one_gpu.sh's raw result files."""

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, load_script, repo_env

TABLE = REPO / "scripts" / "gpu" / "one_gpu_table.py"


def _mission(folder, name: str, step_s: float, machine: str = "NVIDIA H100 80GB HBM3 x1") -> None:
    median = {"step_s": step_s, "generate_s": 3.9, "train_s": 1.7, "sync_s": 0.009, "gen_tokens_per_s": 33000.0,
              "build_s": 0.52, "recompute_s": 0.45}
    (folder / f"mission_{name}.json").write_text(json.dumps({
        "name": name, "exit": 0, "env": [f"ONE_GPU_MACHINE={machine}"], "start_s": 101.5, "exit_lag_s": 0.3,
        "median": median, "per_step": {}}))


def _size(row: str, tag: str, *, fits: bool, gpu: str, fit_line: str | None = None, refusal: str | None = None) -> str:
    return json.dumps({
        "row": row, "tag": tag, "fits": fits, "exit_code": 0 if fits else 2, "refusal": refusal, "fit": fit_line,
        "args": f"--generator.sleep off{'' if fit_line else ' --job.fit off'} gpu={gpu} wall_s=300",
        "peak_gpu_mem_mib": {"0": 71680, "1": 0},
        "median": {"step_s": 15.1, "generate_s": 4.6, "train_s": 7.4, "sync_s": 0.25} if fits else {},
        "trainer_mfu": 0.421 if fits else None})


def test_rows_name_their_machine_and_the_rows_not_run_say_so(tmp_path):
    old, new = tmp_path / "results", tmp_path / "out"
    old.mkdir()
    new.mkdir()
    _mission(old, "mission", 6.74)
    _mission(new, "mission", 4.81)  # the call's own result wins over the committed one
    _mission(new, "colocated2", 2.95, machine="NVIDIA H200 x2")
    (old / "20261130T0025_h200").mkdir()  # a later lease's run of a row: its own line, the first one's kept
    _mission(old / "20261130T0025_h200", "mission", 5.40, machine="NVIDIA H200 x1")
    (new / "sizes.jsonl").write_text("\n".join([
        _size("4B:a:off", "auto", fits=True, gpu="NVIDIA H200 capped=79.2GiB",
              fit_line="torchtitan_rl: job.fit auto: generator.sleep weights, trainer.master_dtype bfloat16: the "
                       "estimate's peak 110.2 GiB per GPU is above 75.2 of 79.2 GiB; now 71.3"),
        _size("8B:b:off", "hand", fits=False, gpu="NVIDIA H100 80GB HBM3",
              refusal="torchtitan_rl: error: memory: this run needs at least 92.7 GiB on cuda:0 (memory per GPU "
                      "(estimate): trainer 8.19B params ...)"),
    ]) + "\n")
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n<!-- Other (cpu) -->\n## Other (cpu)\nkept\n<!-- /Other (cpu) -->\n")
    proc = subprocess.run([sys.executable, str(TABLE), "--results", str(new), str(old), "--write", str(doc)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = doc.read_text()
    assert "## Other (cpu)\nkept" in text  # other sections untouched
    assert text.count("<!-- One 80 GB GPU (cuda) -->") == 1
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("| mission step, one GPU, first start"))
    assert "| NVIDIA H100 80GB HBM3 x1 | 0 | 4.81 | 3.90 | 1.70 | 0.52 (0.45) | 0.01 | 101.50 | 0.30 |" in row
    assert any(line.startswith("| mission step, colocated on two GPUs") and "NVIDIA H200 x2" in line for line in lines)
    later = next(line for line in lines if line.startswith("| mission step, one GPU, first start, torch's allocator"))
    assert "| NVIDIA H200 x1 | 0 | 5.40 |" in later
    assert any(line.startswith("| mission step, one GPU, second start") and "not run" in line for line in lines)
    auto = next(line for line in lines if line.startswith("| Qwen3-4B, layout a, job.fit auto"))
    assert "NVIDIA H200, capped at 79.2GiB | yes | generator.sleep weights, trainer.master_dtype bfloat16 | 70.0 |" \
        in auto and "42.1%" in auto
    refused = next(line for line in lines if line.startswith("| Qwen3-8B, layout b, no sleep"))
    assert "| no: memory: this run needs at least 92.7 GiB on cuda:0 | job.fit off |" in refused
    # Run again on its own output: the section is replaced, not added.
    subprocess.run([sys.executable, str(TABLE), "--results", str(new), "--write", str(doc)], check=True, timeout=60)
    assert doc.read_text().count("## One 80 GB GPU (cuda)") == 1


@pytest.mark.slow  # a real CPU run of two steps: ~30 s
def test_mission_step_times_a_real_run_and_the_table_shows_it(tmp_path):
    """scripts/gpu/mission_step.py as one_gpu.sh runs it, on the CPU config: the start (to step 0's start, read off
    the progress bar) and the exit after the last line come back with the loop's timers, and the table reads them."""
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu" / "mission_step.py"), "--name", "mission", "--steps", "2",
         "--skip", "0", "--config", "run_configs/cpu_tiny.toml", "--out", str(out), "--env", "ONE_GPU_MACHINE=a CPU",
         "--", "--grpo.prompts_per_step", "8"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=repo_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads((out / "mission_mission.json").read_text())
    assert got["exit"] == 0 and got["steps"] == 2 and got["last_line"].startswith("torchtitan_rl: mean reward")
    assert 0 < got["start_s"] < got["wall_s"] and 0 <= got["exit_lag_s"] < 2.0 and got["output_closed_lag_s"] < 2.0, got
    # the run, then main returned between the last line and the process's end (the clocks' conversion: a few ms)
    assert -0.1 < got["trained_lag_s"] <= got["returned_lag_s"] < got["exit_lag_s"] + 0.1, got
    assert {"step_s", "build_s", "recompute_s", "evaluation_s", "log_s"} <= set(got["median"])
    assert got["median"]["recompute_s"] <= got["median"]["build_s"] < got["median"]["step_s"]
    subprocess.run([sys.executable, str(TABLE), "--results", str(out), "--write", str(tmp_path / "b.md")], check=True,
                   timeout=60, env=repo_env())
    row = next(line for line in (tmp_path / "b.md").read_text().splitlines()
               if line.startswith("| mission step, one GPU, first start"))
    assert "| a CPU | 0 |" in row
    assert row.endswith(f"| {got['exit_lag_s']:.2f} ({got['output_closed_lag_s']:.2f}) "
                        f"[{got['trained_lag_s']:.2f} / {got['returned_lag_s']:.2f}] |")


def test_the_exit_is_the_process_s_end_and_the_output_closes_when_its_last_holder_goes():
    """A child left holding the pipe (as a compile worker can) delays the output's end, not the process's."""
    mission_step = load_script("scripts/gpu/mission_step.py")
    proc = subprocess.Popen(["bash", "-c", "echo last; (sleep 1.5; echo) & exit 0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    lines, ended, closed = mission_step.timed_lines(proc)
    assert [line for _, line in lines] == ["last"] and proc.returncode == 0
    assert ended - lines[-1][0] < 0.75 < 1.25 < closed - lines[-1][0], (ended, closed, lines)
