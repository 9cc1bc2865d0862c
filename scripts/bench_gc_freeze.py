"""Engine build with the process's heap frozen for the cycle collector (engine/in_process.py) vs not.

Each repeat runs, in a fresh process, a short CPU loop (cpu_tiny, 3 steps, imports done before the clock starts)
with the engine built as the loop builds it, then once more with ``_heap_frozen_while_building`` replaced by a
no-op, alternating which goes first; reports the loop's wall time and the time spent in gc.collect.

    python scripts/bench_gc_freeze.py --repeats 3
"""

import argparse
import os
import contextlib
import cProfile
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import table, write_section  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def worker(mode: str) -> None:
    import torchtitan_rl.engine.in_process as in_process
    import torchtitan_rl.engine.vllm_model  # noqa: F401  the imports a loop makes, before the clock
    import torchtitan_rl.trainer.trainer  # noqa: F401
    from torchtitan_rl import simple_grpo
    from torchtitan_rl.config import load_toml
    from vllm import LLMEngine  # noqa: F401

    if mode == "not frozen":
        in_process._heap_frozen_while_building = contextlib.nullcontext
    cfg = load_toml(REPO / "run_configs" / "cpu_tiny.toml")
    cfg.trainer.steps, cfg.job.output_dir = 3, tempfile.mkdtemp()
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    simple_grpo.train(cfg)
    profile.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(profile).stats
    gc_s = sum(v[3] for k, v in stats.items() if k[2] == "<built-in method gc.collect>")
    print("RESULT " + json.dumps({"wall": wall, "gc": gc_s}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", choices=["frozen", "not frozen"])
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    results = {"frozen": [], "not frozen": []}
    for r in range(args.repeats):
        for mode in (("frozen", "not frozen") if r % 2 == 0 else ("not frozen", "frozen")):
            out = subprocess.run([sys.executable, __file__, "--worker", mode], cwd=REPO, capture_output=True,
                                 text=True, env={"OMP_NUM_THREADS": "1", **os.environ}, check=True)
            line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
            results[mode].append(json.loads(line.removeprefix("RESULT ")))
    rows = []
    for mode, runs in results.items():
        rows.append([mode, len(runs), f"{statistics.median(r['wall'] for r in runs):.2f}",
                     f"{statistics.median(r['gc'] for r in runs):.2f}"])
    ratio = statistics.median(r["wall"] for r in results["frozen"]) / statistics.median(
        r["wall"] for r in results["not frozen"])
    body = ("cpu_tiny, 3 steps in one process (engine build, 3 steps, engine shutdown; imports before the clock), "
            "medians; gc = seconds inside gc.collect (vLLM collects the whole heap after its model load, after the "
            "KV-cache profile and when it freezes the heap; at shutdown twice more, which the freeze does not "
            "change).\n\n"
            + table(["engine build", "runs", "loop wall s", "gc.collect s"], rows)
            + f"\n\n- frozen / not frozen = {ratio:.2f}x loop wall\n")
    write_section("Engine build: the heap frozen", device="cpu", body=body)


if __name__ == "__main__":
    main()
