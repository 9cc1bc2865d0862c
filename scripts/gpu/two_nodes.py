"""Two launchers on one multi-GPU machine, run as two machines would run them (docs/cluster.md).

Each launcher sees half the GPUs (CUDA_VISIBLE_DEVICES), as a machine sees its own; they meet at a c10d rendezvous
on 127.0.0.1. A rank must take its machine's GPU LOCAL_RANK: here that is physical GPU machine * G + LOCAL_RANK, and
a rank that took RANK instead would ask machine 1 for a GPU it does not have. nvidia-smi, sampled while the job
runs, shows which physical GPU each rank's process holds (the in-process vLLM engine included).

    # after the stash call of docs/gpu.md, on a 4-GPU machine (two 2-GPU "machines"):
    run(kind="nvidia-h100-x4", carry=[".gpu/b"], command="source .gpu/b/install.sh && \
        python3 scripts/gpu/two_nodes.py --out $OUT")

Layouts (--layouts): ``colocated`` (every rank trains and generates; a checkpoint at step 2, then both launchers
again with --resume to step 4), ``nccl`` (machine 0 trains, its two ranks FSDP; machine 1 holds the two generator
replicas). Writes $OUT/two_nodes.json and the section "Two machines on one host" of docs/benchmarks.md (copied to
$OUT/benchmarks.md). --device cpu runs the same on CPU (cpu_tiny, no nvidia-smi): the script's own check.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

from bench_common import write_section  # noqa: E402
from tests.helpers import free_port  # noqa: E402

SECTION = "Two machines on one host"


def placement(apps_csv: str, gpus_csv: str, environs: dict[int, dict[str, str]]) -> dict[int, set[int]]:
    """RANK -> the physical GPU indices its process held, from nvidia-smi's compute apps (``pid, gpu_uuid`` lines),
    its GPUs (``index, uuid`` lines) and each process's torchrun variables (pid -> environ)."""
    index = {}
    for line in gpus_csv.strip().splitlines():
        i, uuid = (part.strip() for part in line.split(","))
        index[uuid] = int(i)
    held: dict[int, set[int]] = {}
    for line in apps_csv.strip().splitlines():
        pid, uuid = (part.strip() for part in line.split(","))
        env = environs.get(int(pid))
        if env is not None and "RANK" in env and uuid in index:
            held.setdefault(int(env["RANK"]), set()).add(index[uuid])
    return held


def rows(layout: str, ranks: dict[int, dict[str, str]], held: dict[int, set[int]]) -> list[dict]:
    """One row per rank: where torchrun put it, which GPU it should hold (its machine's visible GPU number
    LOCAL_RANK), which it held."""
    out = []
    for rank in sorted(ranks):
        env = ranks[rank]
        node, local = int(env["GROUP_RANK"]), int(env["LOCAL_RANK"])
        visible = env.get("CUDA_VISIBLE_DEVICES")
        expected = int(visible.split(",")[local]) if visible else local
        seen = sorted(held.get(rank, ()))
        out.append({"layout": layout, "rank": rank, "machine": node, "local_rank": local, "expected_gpu": expected,
                    "gpus": seen, "ok": seen == [expected]})
    return out


def table(results: list[dict]) -> str:
    lines = ["| layout | both exit 0 | steps | median step (s) | rank | machine | LOCAL_RANK | GPU held | expected |",
             "|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        head = [result["layout"], "yes" if result["exit_codes"] == [0, 0] else f"no {result['exit_codes']}",
                str(result["steps"]), f"{result['median_step_s']:.2f}" if result["median_step_s"] else "-"]
        for row in result["placement"] or [{}]:
            gpus = ", ".join(map(str, row.get("gpus", []))) or "-"
            mark = "" if row.get("ok", True) else " **wrong**"
            lines.append("| " + " | ".join(head + [str(row.get("rank", "-")), str(row.get("machine", "-")),
                                                    str(row.get("local_rank", "-")), gpus + mark,
                                                    str(row.get("expected_gpu", "-"))]) + " |")
            head = ["", "", "", ""]
    return "\n".join(lines)


def _sample(stop: threading.Event, apps: list[str]) -> None:
    while not stop.is_set():
        try:
            apps.append(subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=30).stdout)
        except (OSError, subprocess.TimeoutExpired):
            pass
        stop.wait(1.0)


def run_layout(name: str, args, *extra: str, gpus_per_node: int) -> dict:
    """Both launchers of one job; its exit codes, metrics and (on CUDA) where each rank ran."""
    out = Path(args.work) / name.split("+")[0]
    port = free_port()
    procs = []
    for node in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        if args.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(node * gpus_per_node + i) for i in range(gpus_per_node))
        cmd = [sys.executable, "-m", "torchtitan_rl.launch", "--nnodes", "2", "--node-rank", str(node),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--local-addr", "127.0.0.1",
               "--nproc-per-node", str(gpus_per_node), "-m", "torchtitan_rl.simple_grpo", "--config", args.config,
               "--job.output_dir", str(out), "--job.device", args.device, *extra, *args.extra]
        log = open(Path(args.work) / f"{name}.node{node}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(1.0)  # node 0 first: c10d numbers the machines by launcher pid on one host
    stop, apps = threading.Event(), []
    environs: dict[int, dict[str, str]] = {}
    sampler = threading.Thread(target=_sample, args=(stop, apps), daemon=True) if args.device == "cuda" else None
    if sampler:
        sampler.start()
    deadline = time.monotonic() + args.timeout_s
    while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
        for p, _ in procs:  # the ranks' torchrun variables while they live
            try:
                for child in psutil.Process(p.pid).children():
                    if child.pid not in environs and "RANK" in (env := child.environ()):
                        environs[child.pid] = env
            except psutil.Error:
                pass
        time.sleep(0.5)
    for p, log in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        log.close()
    stop.set()
    held = {}
    if sampler:
        sampler.join()
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True,
                              text=True).stdout
        held = placement("\n".join(apps), gpus, environs)
    ranks = {int(env["RANK"]): env for env in environs.values()}
    metrics = out / "latest" / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return {"layout": name, "exit_codes": [p.returncode for p, _ in procs], "steps": len(steps),
            "median_step_s": statistics.median(s["step_s"] for s in steps) if steps else None,
            "placement": rows(name, ranks, held) if args.device == "cuda" else [
                {"rank": r, "machine": int(e["GROUP_RANK"]), "local_rank": int(e["LOCAL_RANK"])}
                for r, e in sorted(ranks.items())]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_out"))
    parser.add_argument("--work", default="/tmp/two_nodes")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--config", default=None, help="default: qwen3_0.6b.toml on cuda, cpu_tiny.toml on cpu")
    parser.add_argument("--gpus-per-node", type=int, default=2)
    parser.add_argument("--layouts", nargs="+", default=["colocated", "nccl"])
    parser.add_argument("--timeout-s", type=float, default=180.0, help="per job (both launchers)")
    parser.add_argument("extra", nargs="*", help="more overrides for every run, after --")
    args = parser.parse_args()
    args.config = args.config or str(REPO / "run_configs" / ("qwen3_0.6b.toml" if args.device == "cuda"
                                                              else "cpu_tiny.toml"))
    # A check of placement, not a benchmark: no compile, no CUDA graphs, a small batch (start-up is most of it).
    quick = (["--grpo.prompts_per_step", "8"] if args.device == "cpu" else
             ["--grpo.prompts_per_step", "16", "--trainer.compile", "false", "--generator.enforce_eager", "true"])
    args.extra = [*quick, *args.extra]
    shutil.rmtree(args.work, ignore_errors=True)
    Path(args.work).mkdir(parents=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    g = args.gpus_per_node
    results = []
    for layout in args.layouts:
        if layout == "colocated":
            ckpt = ("--trainer.checkpoint.enable", "--trainer.checkpoint.interval", "2")
            results.append(run_layout("colocated", args, "--trainer.steps", "3", *ckpt, gpus_per_node=g))
            results.append(run_layout("colocated+resume", args, "--trainer.steps", "4", "--resume", *ckpt,
                                      gpus_per_node=g))
        elif layout == "nccl":
            engine = ("--generator.gpu_memory_utilization", "0.8") if args.device == "cuda" else ()  # a GPU of its own
            results.append(run_layout("nccl", args, "--trainer.steps", "3", "--weight_sync.transport", "nccl",
                                      "--generator.parallelism.data_parallel_replicate_degree", str(g), *engine,
                                      gpus_per_node=g))
        else:
            raise SystemExit(f"unknown layout {layout!r} (colocated, nccl)")
        print(json.dumps(results[-1]), flush=True)
    (Path(args.out) / "two_nodes.json").write_text(json.dumps(results, indent=1))
    body = (f"Two launchers on one host, each seeing {g} GPUs (CUDA_VISIBLE_DEVICES), at one c10d rendezvous "
            "(scripts/gpu/two_nodes.py, docs/cluster.md). A rank must hold its machine's visible GPU number LOCAL_RANK "
            "(expected: that GPU's physical index) and no other, in nvidia-smi's compute apps sampled each second; "
            "colocated+resume is both launchers again with --resume from the step-2 checkpoint.\n\n" + table(results))
    write_section(SECTION, device=args.device, body=body)
    shutil.copy(REPO / "docs" / "benchmarks.md", Path(args.out) / "benchmarks.md")
    bad = [r for r in results if r["exit_codes"] != [0, 0] or not all(p.get("ok", True) for p in r["placement"])]
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
