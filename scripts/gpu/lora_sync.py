"""LoRA sync on the GPU: scripts/bench_lora_sync.py's measurement, one process per (model, mode).

vLLM engines built in-process keep their GPU memory, so the six engines of
bench_lora_sync.py (two models x three modes) are started one per process;
the table is bench_lora_sync.py's, written to the same section.

    python3 scripts/gpu/lora_sync.py --flavors 0.6B 1.7B --json /tmp/lora.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(SCRIPTS))


def modes(rank: int) -> dict:
    from torchtitan_rl.config import LoRAConfig

    return {
        "full model (no LoRA)": LoRAConfig(rank=0),
        f"LoRA r={rank}, adapter-only": LoRAConfig(rank=rank, sync="adapter"),
        f"LoRA r={rank}, merged": LoRAConfig(rank=rank, sync="merged"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavors", nargs="+", default=["0.6B", "1.7B"])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None, help="also write the raw results here")
    parser.add_argument("--worker", nargs=2, default=None, metavar=("FLAVOR", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from bench_lora_sync import one_mode

        flavor, mode = args.worker
        with tempfile.TemporaryDirectory() as tmp:
            res = one_mode(flavor, modes(args.rank)[mode], device="cuda", repeats=args.repeats, workdir=Path(tmp))
        Path(args.worker_out).write_text(json.dumps(res))
        sys.stdout.flush()
        os._exit(0)  # skip vLLM's in-process engine teardown

    from bench_common import table, write_section

    results: dict[str, dict[str, dict]] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for flavor in args.flavors:
            results[flavor] = {}
            for mode in modes(args.rank):
                out = Path(tmp) / "res.json"
                out.unlink(missing_ok=True)
                cmd = [sys.executable, __file__, "--rank", str(args.rank), "--repeats", str(args.repeats),
                       "--worker", flavor, mode, "--worker-out", str(out)]
                if subprocess.run(cmd).returncode == 0 and out.exists():
                    results[flavor][mode] = json.loads(out.read_text())
                    print(f"[lora_sync] {flavor} / {mode}: {results[flavor][mode]}", flush=True)
                else:
                    print(f"[lora_sync] {flavor} / {mode}: failed", flush=True)
            full = results[flavor].get("full model (no LoRA)")
            for mode, r in results[flavor].items():
                speedup = f"{full['steady_s'] / r['steady_s']:.1f}x" if full else ""
                rows.append([flavor, mode, f"{r['first_s'] * 1e3:.2f}", f"{r['steady_s'] * 1e3:.2f}",
                             f"{r['bytes'] / 2**20:.2f}", speedup])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    body = table(["model", "mode", "first sync ms", "later syncs ms (median)", "MiB moved per later sync",
                  "speed-up vs full"], rows)
    body += ("\nFirst sync in adapter mode moves base + adapter; every later one only the adapter, "
             "as one flat buffer. Merged mode moves W + scale*B@A for every weight each time. "
             "One process per model and mode (scripts/gpu/lora_sync.py).\n")
    write_section("LoRA sync (cuda)", device="cuda", body=body)


if __name__ == "__main__":
    main()
