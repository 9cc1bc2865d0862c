"""A process's start-up with the cycle collector paused (torchtitan_rl/collector.py) vs not.

Each repeat runs the README's command as a fresh process (python -m torchtitan_rl.simple_grpo --config C
--trainer.steps N: imports, trainer and engine builds, the steps, the metrics' plot and shutdown), once as
shipped and once with ``gc.disable`` made a no-op in that process (so ``collector.paused`` pauses nothing:
the start-up's imports and builds and the generates run with the collector on), alternating which goes
first; reports the medians of the process's wall and CPU time, as a test's subprocess or a torchrun rank pays
them, the run's median step after its first, and on a GPU the peak of nvidia-smi's memory.used (whether
cycles left for later while paused raised the start's peak).

    python scripts/bench_startup_gc.py --repeats 3
    python scripts/bench_startup_gc.py --repeats 2 --config run_configs/qwen3_0.6b.toml --steps 4
"""

import argparse
import json
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
from torchtitan_rl.config import load_toml  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RUN = "from torchtitan_rl.simple_grpo import main; main(sys.argv[1:])"
MODES = {"paused (as shipped)": "import sys; " + RUN,
         "collector on": "import gc, sys; gc.disable = lambda: None; " + RUN}


def one(code: str, *, config: str, steps: int, cuda: bool) -> dict:
    """One run in a fresh process: wall s, CPU s, median step_s after the first, peak GPU MiB (CUDA)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-lms", "200"],
                           stdout=subprocess.PIPE, text=True) if cuda else None
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([sys.executable, "-c", code, "--config", config, "--trainer.steps", str(steps),
                               "--job.output_dir", out], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        wall = time.perf_counter() - start
        records = [json.loads(line) for line in (Path(out) / "latest" / "metrics.jsonl").read_text().splitlines()]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak = None
    if smi is not None:
        smi.terminate()
        peak = max(int(line.split(",")[0]) for line in smi.communicate()[0].splitlines() if line.strip().isdigit())
    step = statistics.median(r["step_s"] for r in records[1:]) if len(records) > 1 else None
    return {"wall": wall, "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "step": step, "peak": peak}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--config", default="run_configs/cpu_tiny.toml")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1, help="runs first, not counted (a machine's first run "
                        "fills its compile and file caches: 117 s against 80-94 s after on an H200)")
    args = parser.parse_args()
    device = load_toml(REPO / args.config).job.device
    cuda = device.startswith("cuda")
    for _ in range(args.warmup):
        print("warm-up", one(MODES["paused (as shipped)"], config=args.config, steps=args.steps, cuda=cuda), flush=True)
    results = {mode: [] for mode in MODES}
    for r in range(args.repeats):
        for mode in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
            results[mode].append(one(MODES[mode], config=args.config, steps=args.steps, cuda=cuda))
            print(mode, results[mode][-1], flush=True)

    def med(mode: str, key: str) -> float | None:
        values = [run[key] for run in results[mode] if run[key] is not None]
        return statistics.median(values) if values else None

    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    rows = [[mode, len(results[mode]), fmt(med(mode, "wall"), ".2f"), fmt(med(mode, "cpu"), ".2f"),
             fmt(med(mode, "step"), ".3f"), fmt(med(mode, "peak"), ".0f")] for mode in MODES]
    paused, on = "paused (as shipped)", "collector on"
    body = (f"`python -m torchtitan_rl.simple_grpo --config {args.config} --trainer.steps {args.steps}` in a fresh "
            f"process (OMP_NUM_THREADS=1), medians after {args.warmup} uncounted warm-up run(s); \"collector on\" "
            "makes `gc.disable` a no-op in that process. "
            "While the heap only grows (imports of torch, torchtitan, vLLM, transformers; the trainer and engine "
            "builds) every automatic full pass of the cycle collector walks all of it again and finds almost "
            "nothing. step: the run's median step_s after step 0; GPU peak: nvidia-smi's memory.used, sampled "
            "every 200 ms.\n\n"
            + table(["start-up", "runs", "process wall s", "process CPU s", "step s", "GPU peak MiB"], rows)
            + f"\n\n- paused / on = {med(paused, 'wall') / med(on, 'wall'):.2f}x wall, "
            f"{med(paused, 'cpu') / med(on, 'cpu'):.2f}x CPU\n")
    name = "Start-up: the cycle collector paused" + (" (cuda)" if cuda else "")
    write_section(name, device=device, body=body)


if __name__ == "__main__":
    main()
