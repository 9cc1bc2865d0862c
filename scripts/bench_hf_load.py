"""Host memory per rank of a Trainer loading an HF checkpoint: every rank the whole checkpoint (old) vs each rank its
shards (torch.distributed.checkpoint's HF reader, the default).

    python scripts/bench_hf_load.py [--flavor 1.7B] [--ranks 2] [--whole-ranks 1] [--hf-dir /tmp/qwen3_1.7b_random]

Writes a transformers-built random Qwen3 checkpoint of that flavor's shape (bf16 safetensors) to --hf-dir once,
then builds a Trainer on CPU under torchrun in each mode and reports each rank's peak RSS (VmHWM) and build time.
The whole-checkpoint load peaks before anything is sharded (a whole fp32 model plus the whole checkpoint on every
rank, whatever the world size), so it may run on fewer ranks (--whole-ranks) where all of them at once would not fit
the machine; the sharded load runs on --ranks.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.bench_common import table, write_section  # noqa: E402
from torchtitan_rl.models.families import FLAVORS  # noqa: E402


def peak_rss() -> tuple[int, int]:
    """(VmHWM, VmRSS) of this process in bytes."""
    got = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            got[key] = int(value.split()[0]) << 10
    return got["VmHWM"], got["VmRSS"]


def write_checkpoint(flavor: str, folder: Path) -> None:
    """A random Qwen3ForCausalLM of ``flavor``'s shape, built by transformers in bf16 and saved by it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{**FLAVORS[flavor].to_hf_config(), "max_position_embeddings": 4096})
    torch.set_default_dtype(torch.bfloat16)  # never a whole fp32 copy
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(folder)


def worker(hf_dir: str, mode: str, out: str) -> None:
    """One torchrun rank: build the Trainer, report this rank's peak RSS."""
    import torch.distributed as dist

    from torchtitan_rl.config.job_config import ModelConfig, TrainerConfig
    from torchtitan_rl.models.families import resolve_shape
    from torchtitan_rl.trainer import Trainer

    torch.set_num_threads(1)
    shape = resolve_shape(flavor="tiny", hf_checkpoint=hf_dir, vocab_size=0, max_seq_len=512)
    base, _ = peak_rss()
    start = time.perf_counter()
    trainer = Trainer(TrainerConfig(), model_config=ModelConfig(hf_checkpoint=hf_dir), shape=shape, seed=0,
                      device=torch.device("cpu"), output_dir=Path(tempfile.mkdtemp()),
                      sharded_hf_load=mode == "sharded")
    seconds = time.perf_counter() - start
    hwm, rss = peak_rss()
    row = {"rank": dist.get_rank(), "world": dist.get_world_size(), "mode": mode, "peak_rss": hwm,
           "rss_after": rss, "rss_before": base, "seconds": seconds,
           "params": sum(p.numel() for p in trainer.model.parameters())}
    Path(f"{out}.{dist.get_rank()}").write_text(json.dumps(row))
    dist.destroy_process_group()


def run(hf_dir: Path, mode: str, ranks: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
               str(29500 + os.getpid() % 1000), __file__, "--worker", mode, "--hf-dir", str(hf_dir),
               "--worker-out", str(out)]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        if subprocess.run(cmd, env=env).returncode != 0:
            raise SystemExit(f"FAIL: the {mode} load failed")
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(ranks)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="1.7B")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--whole-ranks", type=int, default=1)
    p.add_argument("--hf-dir", default=None)
    p.add_argument("--no-write", action="store_true", help="print the table, leave docs/benchmarks.md alone")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    hf_dir = Path(args.hf_dir or f"/tmp/qwen3_{args.flavor.lower()}_random")
    if args.worker:
        return worker(str(hf_dir), args.worker, args.worker_out)
    if not (hf_dir / "config.json").exists():
        write_checkpoint(args.flavor, hf_dir)
    gib = lambda n: f"{n / (1 << 30):.2f}"  # noqa: E731
    size = sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))
    rows = []
    for mode, ranks in (("whole", args.whole_ranks), ("sharded", args.ranks)):
        for r in run(hf_dir, mode, ranks):
            rows.append([mode, f"{r['rank']} of {r['world']}", gib(r["peak_rss"]), gib(r["rss_after"]),
                         gib(r["rss_before"]), f"{r['seconds']:.1f}"])
    body = (f"Qwen3-{args.flavor} shape, random weights built by transformers ({gib(size)} GiB of bf16 safetensors), "
            "trainer.master_dtype float32, CPU ranks (gloo). whole: every rank reads the whole checkpoint into a "
            "whole fp32 model, then FSDP keeps its shard (the peak comes before sharding, the same on every rank "
            "at any world size); sharded: the model starts on the meta device and each rank reads only its "
            "shards' rows (torch.distributed.checkpoint.HuggingFaceStorageReader, safetensors slices).\n\n"
            + table(["load", "rank", "peak RSS GiB", "RSS after GiB", "RSS before build GiB", "build s"], rows))
    if args.no_write:
        print(body)
    else:
        write_section(f"HF checkpoint load per rank (Qwen3-{args.flavor}, cpu)", device="cpu", body=body)


if __name__ == "__main__":
    main()
