"""Engine launch: our in-process patches (engine/in_process.py) vs vLLM's external_launcher executor.

Builds the generator's vLLM engine (run config's generator settings, our model class, dummy weights)
two ways in each layout that builds an in-process engine, one fresh process (or torchrun job) per start:

- patches: ``engine.engine.build_engine`` as the loop builds it (uni executor, private world, kept
  groups, CPU async scheduling);
- external_launcher: the same EngineArgs with ``distributed_executor_backend="external_launcher"`` and
  none of our patches (vLLM's world over torchrun's env; a lone process gets RANK=0 etc. set here).

Layouts: one (one process), every (2 ranks, each its own engine on the trainer's default group, a
different number of prompts each), first (2 ranks, rank 0 alone builds one), own_rank (2 ranks through
distributed.world.init_world: rank 0 trains, rank 1 generates), sequential (one process: engine A,
engine B beside it, A shut down, B still generating, a third after B's shutdown). A start that does not
finish within --timeout is reported as hung. build = the engine constructor; peak = the process's peak
RSS (VmHWM) after the build and a short generate; over = peak minus the RSS just before the build.

    python scripts/bench_engine_launch.py --repeats 3
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_PROCESS = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import table, write_section  # noqa: E402

MODES = ("patches", "external_launcher")
LAYOUTS = ("one", "every", "first", "own_rank", "sequential")
TORCHRUN = ("every", "first", "own_rank")


def _mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(field)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Builder:
    """Builds engines of the run config's generator settings, either way."""

    def __init__(self, config: str, mode: str, workdir: Path) -> None:
        from torchtitan_rl.config import parse_args
        from torchtitan_rl.grpo import build_task
        from torchtitan_rl.models.families import resolve_shape

        cfg = parse_args(["--config", config, "--job.output_dir", str(workdir)])
        vocab = cfg.model.vocab_size or build_task(cfg.grpo.task).vocab_size
        shape = resolve_shape(flavor=cfg.model.flavor, hf_checkpoint=None, vocab_size=vocab,
                              max_seq_len=cfg.model.max_seq_len)
        self.mode, self.cfg = mode, cfg
        self.model_dir = workdir / "generator_model"
        self.model_dir.mkdir(parents=True, exist_ok=True)
        (self.model_dir / "config.json").write_text(json.dumps(shape.to_hf_config()))
        self.vocab = vocab

    def build(self):
        from torchtitan_rl.engine.vllm_model import BATCH_INVARIANT_KEY, COMPILE_KEY, LORA_KEY, TITAN_ARCH, register

        g, m = self.cfg.generator, self.cfg.model
        common = dict(
            model=str(self.model_dir), load_format="dummy", dtype=m.dtype, max_model_len=g.max_model_len,
            max_num_seqs=g.max_num_seqs, enforce_eager=g.enforce_eager, async_scheduling=g.async_scheduling,
            tensor_parallel_size=1, seed=0, enable_sleep_mode=False,
            hf_overrides={"architectures": [TITAN_ARCH], BATCH_INVARIANT_KEY: False, LORA_KEY: None,
                          COMPILE_KEY: False},
        )
        if self.mode == "patches":
            from torchtitan_rl.engine.engine import build_engine

            return build_engine(**common, device="cpu", gpu_memory_utilization=g.gpu_memory_utilization,
                                kv_cache_memory_bytes=int(g.kv_cache_memory_gb * (1 << 30)),
                                batch_invariant=False)
        # What build_llm_engine passes to EngineArgs on CPU, minus its patches.
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                           ("MASTER_PORT", str(_free_port()))):
            os.environ.setdefault(key, value)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        register()
        from vllm import EngineArgs, LLMEngine

        return LLMEngine.from_engine_args(EngineArgs(
            **common, distributed_executor_backend="external_launcher", skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs", disable_log_stats=True,
            kv_cache_memory_bytes=int(g.kv_cache_memory_gb * (1 << 30)), enable_chunked_prefill=False,
            max_num_batched_tokens=max(2048, g.max_model_len),
        ))

    def generate(self, engine, prompts: int, tag: str, tokens: int = 4) -> int:
        """Token count of ``prompts`` seeded ``tokens``-token completions (the engine stepped to the end)."""
        from vllm import SamplingParams

        for i in range(prompts):
            engine.add_request(f"{tag}{i}", {"prompt_token_ids": [1, 2 + i % 7, 3, 4]},
                               SamplingParams(max_tokens=tokens, seed=i, ignore_eos=True))
        tokens = 0
        while engine.has_unfinished_requests():
            tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        return tokens


def worker(layout: str, mode: str, config: str, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from torchtitan_rl import compat

    rank = int(os.environ.get("RANK", 0))
    res = {"rank": rank, "import_s": time.perf_counter() - T_PROCESS}
    workdir = Path(tempfile.mkdtemp(prefix="engine_launch_"))
    builder = Builder(config, mode, workdir)
    trainer_group = None
    builds = True
    if layout in ("every", "first"):  # the trainer's default group over every rank, as the colocated loop has it
        dist.init_process_group("gloo")
        trainer_group = dist.group.WORLD
        builds = layout == "every" or rank == 0
    elif layout == "own_rank":
        from torchtitan_rl.distributed.world import init_world

        world = init_world("cpu", replicas=1)
        builds = world.role == "generator"
        if not builds:
            trainer_group = dist.group.WORLD
    if layout == "sequential":
        engines, steps = {}, []

        def step(name, fn):
            try:
                steps.append((name, f"ok, {fn()} tokens"))
            except Exception as e:  # the next steps still say what a fresh engine does after this
                steps.append((name, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"))

        def build(name):
            engines[name] = builder.build()
            return builder.generate(engines[name], 2, name)

        step("A built, generates", lambda: build("a"))
        step("B built beside A, both generate", lambda: build("b") + builder.generate(engines["a"], 2, "a2"))
        step("A shut down, B generates",
             lambda: compat.shutdown_engine(engines["a"]) or builder.generate(engines["b"], 2, "b2"))
        step("B shut down, C built, generates", lambda: compat.shutdown_engine(engines["b"]) or build("c"))
        res["steps"] = steps
    elif builds:
        before = _mib("VmRSS")
        t = time.perf_counter()
        engine = builder.build()
        res["build_s"] = time.perf_counter() - t
        # Ranks take different numbers of engine steps: nothing may need them in lockstep.
        res["tokens"] = builder.generate(engine, 3 + 5 * rank, f"r{rank}_", tokens=4 + 12 * rank)
        res.update(rss_before_mib=before, peak_mib=_mib("VmHWM"))
        res["multiprocessing_env"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if trainer_group is not None or (layout == "every"):
        x = torch.ones(1)
        dist.all_reduce(x)  # the trainer's default group still serves after the engines were built
        res["trainer_all_reduce"] = x.item()
    if layout == "own_rank":
        from torchtitan_rl.distributed.world import broadcast

        broadcast(world.group, torch.ones(1), root=0).wait()
    if builds and layout != "sequential":
        compat.shutdown_engine(engine)
        res["default_group_after_shutdown"] = dist.is_initialized()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    print(json.dumps(res), flush=True)
    os._exit(0)  # skip the interpreter's teardown of vLLM and gloo threads


def start(layout: str, mode: str, config: str, timeout: float) -> dict:
    """One start in a fresh process (or 2-rank torchrun job): its ranks' results, its wall time, and how it ended."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        me = [__file__, "--worker", layout, "--mode", mode, "--config", config, "--out", str(out)]
        if layout in TORCHRUN:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-port", str(_free_port()), *me]
        else:
            cmd = [sys.executable, *me]
        env = {**os.environ, "OMP_NUM_THREADS": "1"} if layout in TORCHRUN else dict(os.environ)
        t = time.perf_counter()
        # Its own session, so a hung torchrun job's ranks go down with it (and nothing else).
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            text, _ = proc.communicate(timeout=timeout)
            ended = "ok" if proc.returncode == 0 else "failed: " + _last_error(text)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            ended = f"hung (> {timeout:.0f} s)"
        (Path(tempfile.gettempdir()) / f"engine_launch_{layout}_{mode}.log").write_text(text)
        wall = time.perf_counter() - t
        ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))] if out.exists() else []
    if ended != "ok" or len(ranks) != (2 if layout in TORCHRUN else 1):
        ended = ended if ended != "ok" else "failed: a rank wrote no result"
    print(f"[bench_engine_launch] {layout} / {mode}: {ended} in {wall:.0f} s", flush=True)
    return {"ended": ended, "wall_s": wall, "ranks": ranks}


def _last_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if "Error" in line or "error" in line]
    return (lines[-1] if lines else text.strip().splitlines()[-1] if text.strip() else "no output")[:200]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="run_configs/cpu_tiny.toml")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--repeats", type=int, default=3, help="starts per mode in the one and every layouts")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a start counts as hung")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.mode, args.config, Path(args.out))

    results = {}
    for layout in args.layouts:
        repeats = args.repeats if layout in ("one", "every") else 1
        for i in range(repeats):
            # Alternated, first one way then the other, so a load change on the shared CPU hits both alike.
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                results.setdefault(f"{layout}/{mode}", []).append(start(layout, mode, args.config, args.timeout))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    write_section("Engine launch: in-process patches vs vLLM's external_launcher", device="cpu",
                  body=report(results, args))


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def report(results: dict, args) -> str:
    rows, numbers = [], {}
    for layout in args.layouts:
        for mode in MODES:
            starts = results.get(f"{layout}/{mode}", [])
            ok = [s for s in starts if s["ended"] == "ok"]
            if layout == "sequential":
                detail = "; ".join(f"{name}: {what}" for name, what in ok[0]["ranks"][0]["steps"]) if ok else ""
                rows.append([layout, mode, f"{len(ok)}/{len(starts)}", "", "", "", "", "",
                             detail or starts[0]["ended"] if starts else "not run"])
                continue
            built = [r for s in ok for r in s["ranks"] if "build_s" in r]
            if not built:
                rows.append([layout, mode, f"0/{len(starts)}", *[""] * 5, starts[0]["ended"] if starts else ""])
                continue
            build = _median([r["build_s"] for r in built])
            peak = _median([r["peak_mib"] for r in built])
            over = _median([r["peak_mib"] - r["rss_before_mib"] for r in built])
            wall = _median([s["wall_s"] for s in ok])
            fastest = min(r["build_s"] for r in built)
            numbers[(layout, mode)] = (build, peak, over, wall, fastest)
            group = {r.get("default_group_after_shutdown") for r in built} - {None}
            notes = f"default group alive after engine shutdown: {'/'.join(map(str, sorted(group)))}"
            notes += "; tokens by rank: " + ", ".join(str(r["tokens"]) for r in ok[0]["ranks"] if "tokens" in r)
            if any("trainer_all_reduce" in r for s in ok for r in s["ranks"]):
                notes += "; trainer all_reduce after the build: ok"
            rows.append([layout, mode, f"{len(ok)}/{len(starts)}", f"{build:.2f}", f"{fastest:.2f}", f"{peak:.0f}",
                         f"{over:.0f}", f"{wall:.1f}", notes])
    ratios = []
    for layout in args.layouts:
        p, e = numbers.get((layout, "patches")), numbers.get((layout, "external_launcher"))
        if p and e:
            ratios.append(f"{layout}: external_launcher / patches = build {e[0] / p[0]:.2f}x (fastest "
                          f"{e[4] / p[4]:.2f}x), peak RSS {e[1] / p[1]:.2f}x, RSS over the pre-build "
                          f"{e[2] / p[2]:.2f}x, process {e[3] / p[3]:.2f}x")
    return (
        f"`{args.config}` generator settings (tiny Qwen3, dummy weights, enforce_eager), one fresh process or "
        f"2-rank torchrun job per start, {args.repeats} starts per mode in the one/every layouts (the modes "
        f"alternating, each first in turn), 1 elsewhere; medians over starts and ranks. The CPU was shared "
        f"with other jobs: only the ratios within one table mean much. build = the engine constructor (s), "
        f"fastest = its quickest start (the least disturbed by other jobs); peak = VmHWM after the build and "
        f"a generate (MiB; rank 0: 3 prompts x 4 tokens, rank 1: 8 x 16, so the ranks step apart); over = "
        f"peak minus the RSS just before the build (MiB); process = wall of the whole process or torchrun job "
        f"incl. imports (s); a start not done in {args.timeout:.0f} s "
        f"is hung. Both ways run the same UniProcExecutor worker; external_launcher differs in how vLLM's "
        f"groups are made: over the whole default group (a rank without an engine never joins its new_group: "
        f"`first` hangs), and torn down with it at shutdown (EngineCore.shutdown -> "
        f"cleanup_dist_env_and_memory -> destroy_process_group).\n\n"
        + table(["layout", "mode", "ok", "build s", "fastest s", "peak MiB", "over MiB", "process s", "notes"], rows)
        + ("\n" + "\n".join(f"- {r}" for r in ratios) + "\n" if ratios else "")
    )


if __name__ == "__main__":
    main()
