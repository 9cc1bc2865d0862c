"""A process's start-up with the cycle collector paused (torchtitan_rl/collector.py) vs not.

Each repeat runs the README's command as a fresh process (python -m torchtitan_rl.simple_grpo, cpu_tiny,
--trainer.steps 1: imports, trainer and engine builds, one step, export of the metrics and shutdown), once as
shipped and once with ``gc.disable`` made a no-op in that process (so ``collector.paused`` pauses nothing:
the start-up's imports and builds and the one generate run with the collector on), alternating which goes
first; reports the medians of the process's wall and CPU time, as a test's subprocess or a torchrun rank pays them.

    python scripts/bench_startup_gc.py --repeats 3
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import table, write_section  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RUN = "from torchtitan_rl.simple_grpo import main; main(sys.argv[1:])"
MODES = {"paused (as shipped)": "import sys; " + RUN,
         "collector on": "import gc, sys; gc.disable = lambda: None; " + RUN}


def one(code: str) -> tuple[float, float]:
    """(wall s, CPU s) of one run in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-c", code, "--config", "run_configs/cpu_tiny.toml", "--trainer.steps", "1",
                        "--job.output_dir", out], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       capture_output=True, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results = {mode: [] for mode in MODES}
    for r in range(args.repeats):
        for mode in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
            results[mode].append(one(MODES[mode]))
    med = {mode: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
           for mode, runs in results.items()}
    rows = [[mode, len(results[mode]), f"{wall:.2f}", f"{cpu:.2f}"] for mode, (wall, cpu) in med.items()]
    paused, on = med["paused (as shipped)"], med["collector on"]
    body = ("`python -m torchtitan_rl.simple_grpo --config run_configs/cpu_tiny.toml --trainer.steps 1` in a fresh "
            "process (OMP_NUM_THREADS=1), medians; \"collector on\" makes `gc.disable` a no-op in that process. "
            "While the heap only grows (imports of torch, torchtitan, vLLM, transformers; the trainer and engine "
            "builds) every automatic full pass of the cycle collector walks all of it again and finds almost "
            "nothing.\n\n"
            + table(["start-up", "runs", "process wall s", "process CPU s"], rows)
            + f"\n\n- paused / on = {paused[0] / on[0]:.2f}x wall, {paused[1] / on[1]:.2f}x CPU\n")
    write_section("Start-up: the cycle collector paused", device="cpu", body=body)


if __name__ == "__main__":
    main()
