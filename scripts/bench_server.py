"""The rollout server under load vs the in-process generator, and LoRA updates through it.

    python scripts/bench_server.py                       # CPU: tiny model load test + LoRA on debugmodel
    python scripts/bench_server.py --lora-flavor 0.6B    # LoRA updates of the 0.6B shape
    python scripts/bench_server.py --clients 50,100,200 --no-lora --section "Rollout server latency (cpu)"

1. Load: a server (run_configs/cpu_tiny.toml) synced once; C client threads
   send R requests (one prompt, n completions, max_tokens each); per-request
   latency (p50/p99) and throughput. The same completions, seeds and
   weights from an in-process Engine in this process: all at once (the
   training path) and one request at a time (the latency floor without HTTP).
2. LoRA: a server with model.lora.rank r; the trainer's first sync moves
   base + adapter, every later one only the adapter (one flat bucket).
Server and in-process runs take turns, never overlap (same cores).
"""

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import table, write_section  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.helpers import free_port, native_state, trainer_model  # noqa: E402
from torchtitan_rl.config import LoRAConfig, SamplingConfig, TrainerConfig, WeightSyncConfig, load_toml  # noqa: E402
from torchtitan_rl.engine.engine import Engine  # noqa: E402
from torchtitan_rl.rollout.server_client import ServerGenerator  # noqa: E402
from torchtitan_rl.rollout.server_http import ServerClient  # noqa: E402
from torchtitan_rl.grpo.tasks.digits import DigitsTask  # noqa: E402
from torchtitan_rl.distributed.process_group import init_process_group  # noqa: E402
from torchtitan_rl.weight_sync.sync import WeightSync  # noqa: E402

TOKEN = "bench"
EOS = 2


def start_server(cfg, workdir: Path, *extra: str) -> subprocess.Popen:
    log = open(workdir / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_rl.serve", "--config", str(REPO / "run_configs" / "cpu_tiny.toml"),
         "--job.output_dir", str(workdir / "server"), "--serve.port", str(cfg.serve.port),
         "--serve.token", TOKEN, *extra],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    ServerClient(f"http://127.0.0.1:{cfg.serve.port}").wait_ready(600)
    return proc


def config(workdir: Path):
    cfg = load_toml(REPO / "run_configs" / "cpu_tiny.toml")
    cfg.job.output_dir = str(workdir / "trainer")
    cfg.serve.port, cfg.serve.token = free_port(), TOKEN
    cfg.serve.takeover = True  # trainers one after another on one server
    return cfg


def load_test(args, workdir: Path) -> list[list]:
    cfg = config(workdir)
    proc = start_server(cfg, workdir, "--generator.max_num_seqs", "256")
    rows = []
    try:
        model = trainer_model(seed=0)
        trainer = ServerGenerator(cfg, reference=native_state(model), device=torch.device("cpu"))
        trainer.sync(native_state(model), version=1)
        total = max([args.requests] + [args.per_client * c for c in args.clients])
        prompts = [p.token_ids for p in DigitsTask().sample_prompts(total, generator=random.Random(0))]
        body = dict(model=cfg.serve.model_name, n=args.n, max_tokens=args.max_tokens, logprobs=0,
                    return_token_ids=True, stop_token_ids=[EOS])
        client = ServerClient(f"http://127.0.0.1:{cfg.serve.port}")
        for i in range(8):  # warm-up
            client.request("POST", "/v1/completions", {**body, "prompt": prompts[i], "seed": i})

        def run(clients: int, count: int):
            latencies, tokens, next_i, lock = [], [0], [0], threading.Lock()

            def worker():
                while True:
                    with lock:
                        i = next_i[0]
                        next_i[0] += 1
                    if i >= count:
                        return
                    t = time.perf_counter()
                    reply = client.request("POST", "/v1/completions", {**body, "prompt": prompts[i], "seed": i})
                    dt = time.perf_counter() - t
                    with lock:
                        latencies.append(dt)
                        tokens[0] += sum(len(c["token_ids"]) for c in reply["choices"])

            started = time.perf_counter()
            threads = [threading.Thread(target=worker) for _ in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return time.perf_counter() - started, latencies, tokens[0]

        runs = [(c, max(args.requests, args.per_client * c)) for c in args.clients] + [(1, args.sequential)]
        for clients, count in runs:
            wall, lat, toks = run(clients, count)
            q = statistics.quantiles(lat, n=100)
            rows.append([f"server, {clients} concurrent client{'s' * (clients > 1)}", count, toks,
                         f"{wall:.2f}", f"{toks / wall:.0f}", f"{count / wall:.1f}",
                         f"{statistics.median(lat) * 1e3:.0f}", f"{q[98] * 1e3:.0f}"])
        trainer.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    generator = Engine(cfg.generator, model_config=cfg.model, shape=trainer_shape(), seed=0, device="cpu",
                       workdir=workdir / "local")
    try:
        WeightSync(WeightSyncConfig(), reference=native_state(model), generator=generator).sync(
            native_state(model), version=1)
        s = SamplingConfig(max_tokens=args.max_tokens)
        generator.generate(prompts[:8], n=args.n, sampling=s, stop_token_ids=[EOS], seed=0)  # warm-up
        t = time.perf_counter()
        r = generator.generate(prompts[: args.requests], n=args.n, sampling=s, stop_token_ids=[EOS], seed=0)
        wall = time.perf_counter() - t
        toks = sum(map(len, r.completion_ids))
        rows.append(["in-process, all requests as one batch", args.requests, toks, f"{wall:.2f}",
                     f"{toks / wall:.0f}", f"{args.requests / wall:.1f}", "-", "-"])
        lat, toks = [], 0
        started = time.perf_counter()
        for i in range(args.sequential):
            t = time.perf_counter()
            r = generator.generate([prompts[i]], n=args.n, sampling=s, stop_token_ids=[EOS], seed=i)
            lat.append(time.perf_counter() - t)
            toks += sum(map(len, r.completion_ids))
        wall = time.perf_counter() - started
        q = statistics.quantiles(lat, n=100)
        rows.append(["in-process, one request at a time", args.sequential, toks, f"{wall:.2f}", f"{toks / wall:.0f}",
                     f"{args.sequential / wall:.1f}", f"{statistics.median(lat) * 1e3:.0f}", f"{q[98] * 1e3:.0f}"])
    finally:
        generator.close()
    return rows


def trainer_shape():
    from tests.helpers import tiny_shape

    return tiny_shape()


def lora_updates(args, workdir: Path) -> list[list]:
    from torchtitan_rl.models.families import resolve_shape
    from torchtitan_rl.trainer import Trainer

    cfg = config(workdir)
    cfg.model.flavor, cfg.model.lora = args.lora_flavor, LoRAConfig(rank=args.rank)
    cfg.grpo.task_without_checkpoint = "digits"
    cfg.weight_sync.verify = "off"
    extra = ["--model.flavor", args.lora_flavor, "--model.lora.rank", str(args.rank),
             "--weight_sync.verify", "off", "--generator.kv_cache_memory_gb", "1"]
    proc = start_server(cfg, workdir, *extra)
    try:
        vocab = 16 if args.lora_flavor == "tiny" else 0
        shape = resolve_shape(flavor=args.lora_flavor, hf_checkpoint=None, vocab_size=vocab, max_seq_len=64)
        trainer = Trainer(TrainerConfig(), model_config=cfg.model, shape=shape, seed=0, device=torch.device("cpu"),
                          output_dir=workdir / "lora_trainer")
        generator = ServerGenerator(cfg, reference=trainer.sync_state(), device=torch.device("cpu"))
        first = generator.sender.sync(trainer.sync_state(), version=1)
        later = [generator.sender.sync(trainer.sync_state(), version=v) for v in range(2, 2 + args.repeats)]
        generator.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    median = statistics.median(s.seconds for s in later)
    return [
        [args.lora_flavor, "first sync: base + adapter", f"{first.bytes_written / 2**20:.2f}", f"{first.seconds * 1e3:.1f}"],
        [args.lora_flavor, f"later syncs: adapter only (r={args.rank}, median of {args.repeats})",
         f"{later[0].bytes_written / 2**20:.2f}", f"{median * 1e3:.1f}"],
        [args.lora_flavor, "ratio full / adapter", f"{first.bytes_written / later[0].bytes_written:.0f}x",
         f"{first.seconds / median:.1f}x"],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=lambda s: [int(c) for c in s.split(",")], default=[32],
                        help="concurrent clients, one load run per comma-separated count")
    parser.add_argument("--requests", type=int, default=320)
    parser.add_argument("--per-client", type=int, default=0, help="at least this many requests per client")
    parser.add_argument("--sequential", type=int, default=40, help="requests of the one-at-a-time runs")
    parser.add_argument("--n", type=int, default=4, help="completions per request")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lora-flavor", default="debugmodel")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-lora", action="store_true", help="the load test only")
    parser.add_argument("--section", default="Rollout server (cpu)", help="the docs/benchmarks.md section to write")
    args = parser.parse_args()
    init_process_group(torch.device("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "load").mkdir()
        (Path(tmp) / "lora").mkdir()
        load = load_test(args, Path(tmp) / "load")
        lora = [] if args.no_lora else lora_updates(args, Path(tmp) / "lora")
    body = table(["path", "requests", "completion tokens", "wall s", "tokens/s", "requests/s", "p50 ms", "p99 ms"],
                 load)
    body += (f"\nEach request: one digits prompt, n={args.n}, max_tokens={args.max_tokens}, stop at eos, the tiny "
             "Qwen3 (run_configs/cpu_tiny.toml) with synced weights. The in-process batch is the training path "
             "(one generate call); the server's concurrent clients reach the same engine through HTTP, JSON and "
             "continuous batching.\n\n")
    if lora:
        body += table(["model", "sync", "MiB moved", "ms"], lora)
        body += ("\nThrough the server (gloo on CPU, the trainer in this process): the first sync of a LoRA run "
                 "moves base + adapter in buckets, every later one only the adapter, as one flat bucket.\n")
    write_section(args.section, device="cpu", body=body)


if __name__ == "__main__":
    main()
