"""The tables "The long tail" of docs/benchmarks.md, from what scripts/gpu/long_tail.sh left in a results folder.

    python3 scripts/gpu/long_tail_table.py scripts/gpu/results/long_tail/* [--write]

Each RESULTS folder holds the rows of one machine lease (its calls' long_tail.tgz unpacked there): rows compare
only within their folder, so each folder gets its own table, named by the folder and its GPU (from its
summaries; --gpu where it has none). Reads, in each:
  long_tail_<layout>-<size>-<mode>.jsonl   a run's metrics.jsonl (layout a/e/b/d, size 0.6B/1.7B, mode
                                           off/on/fp8/onfp8/stream, each also with -batched: seeded_noise batched,
                                           and -expandable: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
  long_tail_math_<mode>.jsonl              the SmolLM2 math run's metrics.jsonl (mode off/on)
  long_tail_trainer_<size>.json            scripts/bench_trainer.py's --json at the drawn lengths
  long_tail_trainer16k_<size>.json         the same with every row 16k tokens long
  long_tail_trainer*_<size>-expandable.json  either, run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
Each row's numbers are over its steps from its warm-up on (warmup(): step 0 compiles the trainer and its first
wave has no unfinished samples to carry; with partial rollouts in the asynchronous layouts d and e the first
grpo.max_staleness + 1 = 2 requests carry none, and each generates a whole over-sampled pool); a row cut by the
call's time before then shows what it logged, its step count marked * (warm-up only).
Throughput = trained completion tokens / wall, summed over those steps (a step's wall: its step_s and the
logging and checkpoint before it; checkpoint_s holds an async layout's wait for the rollouts in flight):
over-sampled tokens count when they train, not when they are generated (generated / trained says how many more
the engine sampled); the
tail share and batch fill are step means, the idle shares idle seconds over wall seconds (definitions:
docs/design.md, "The long tail"; generator idle counts the engine's wait before each step's batch, so after a
longer step it can pass 100%). KV read TB/s: what the attention read from the KV cache a second of engine loop,
per engine (gen_kv_read_tb_per_s), against the GPU's memory bandwidth (H100 3.35, H200 4.8 TB/s): near it, the
generate is bound by the bytes its samples' contexts take, which no order of decoding changes; "-" for rows
logged before the metric existed; in brackets the rate during the tail's steps (gen_tail_kv_read_tb_per_s), where a
few sequences run: far below the rest, the step's fixed costs or a kernel the small batch does not fill. After need
(partial rollouts): the share of the generate that ran after the groups the step needs had finished, for groups due
to finish (grpo.partial.max_token_age) or the token budget (gen_after_need_s); rows logged before the metric show
the tail share alone. Engine balance (rows of several engines: b, d with replicas): their mean step loop over the
slowest one's, which the step waits for (gen_engine_balance; 100%: they finish together; "-" for rows logged before
the metric existed); in brackets, rows of several trainer ranks (b): their mean tokens trained over the most any rank
trained, which the others wait for (train_rank_balance; rows logged before the metric existed show none).
A row with partial rollouts whose settings differ from scripts/gpu/partial_args.sh's (LONG_TAIL_ON_ARGS, as its
summary records them) names the differences after it, e.g. "a-0.6B-onfp8 (over_sample 128)", and a row run with
torch's allocator in expandable segments (every run's default since 2026-11-29) says so unless its name does.
Speed-up: against the synchronous colocated row of the same size and GPU count (a-off for a and e; b-off for b
and d), as today's default runs it (a -batched row's speed-up includes the noise's); where a row's steps trained
more tokens than they generated (partial rollouts drawing down the pool the warm-up over-sampled), also by the
tokens it generated a second, "(1.46x generated)": the rate a long run can hold. Missing rows are listed as such,
so a partial run still gives its part of the table.
"""

import argparse
import itertools
import json
import math
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_common import BENCHMARKS_MD, table, write_section  # noqa: E402

WARMUP = 1
"""Steps left out at the start."""
PARTIAL = ("on", "onfp8", "stream")
"""Modes with partial rollouts on (scripts/gpu/long_tail.sh's LONG_TAIL_ON_ARGS)."""
LAYOUTS = {"a": "colocated, 1 GPU", "e": "colocated, async, 1 GPU", "b": "colocated, 2 GPUs",
           "d": "own-rank nccl, async, 1 + 1 GPUs"}
BASELINE = {"a": "a", "e": "a", "b": "b", "d": "b"}
"""Speed-ups are against the synchronous (off) colocated row on as many GPUs."""
ASYNC = ("d", "e")
"""Layouts whose generator runs a step ahead (grpo.max_staleness 1)."""
OPTIONAL_LAYOUTS = ("e",)
"""Layouts beside the issue's a/b/d (e: a's GPU, generation overlapping training): never listed as missing."""
SIZES = ("0.6B", "1.7B")
EXPANDABLE = "-expandable"
"""The suffix of a row run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (a trainer row's JSON too)."""
SUFFIXES = ("-batched", EXPANDABLE)
"""A mode's suffixes, in this order: -batched draws every seeded sample's noise in one kernel a step
(generator.seeded_noise); -expandable runs torch's allocator with expandable segments (PYTORCH_CUDA_ALLOC_CONF)."""
MODES = tuple(mode + "".join(suffixes) for mode in ("off", "on", "fp8", "onfp8", "stream")
              for n in range(len(SUFFIXES) + 1) for suffixes in itertools.combinations(SUFFIXES, n))
OPTIONAL = tuple(mode for mode in MODES if mode not in ("off", "on"))
"""Modes beside off/on (the KV cache in fp8; d's streaming without in-flight updates; the suffixes): in the table
when run, never listed as missing."""
PARTIAL_ARGS_SH = Path(__file__).with_name("partial_args.sh")
"""Where long_tail.sh's default LONG_TAIL_ON_ARGS are written (PARTIAL_ON_ARGS)."""
TARGETS = ("Targets (issue 39): tail share <= 10% with partial rollouts on; one GPU (the better of a-on and the e "
           "rows) >= 1.4x a-off; two GPUs (the better of b-on, d-on) >= 2.0x b-off; math: held-out accuracy at step "
           "100 within 2 standard errors.")


def steps(path: Path) -> list[dict]:
    """The per-step lines (evaluation lines carry no step_s)."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in lines if "step_s" in r]


def evals(path: Path) -> list[dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in lines if "eval_accuracy" in r]


def base_mode(mode: str) -> str:
    """The mode without its SUFFIXES: "onfp8-batched-expandable" -> "onfp8"."""
    for suffix in reversed(SUFFIXES):
        mode = mode.removesuffix(suffix)
    return mode


def warmup(layout: str, mode: str) -> int:
    """Steps left out of a row: WARMUP, and in the asynchronous layouts d and e (grpo.max_staleness 1) with partial
    rollouts one more: request 1 is built while request 0 runs, so neither carries a group and both generate a
    whole pool."""
    return WARMUP + 1 if layout in ASYNC and base_mode(mode) in PARTIAL else WARMUP


def row_numbers(records: list[dict], *, skip: int = WARMUP) -> dict | None:
    """A row's numbers over its steps from ``skip`` on, or over the ones it logged (their count marked *: warm-up
    only) when the call's time ended before then; None if it logged no step."""
    kept = [r for r in records if r["step"] >= skip]
    warm = not kept
    kept = kept or records
    if not kept:
        return None
    # A step's wall from the previous one's end: its step_s, and the logging and checkpoint before it (an async
    # layout's checkpoint waits for the rollouts in flight: generate time no step_s holds).
    wall = sum(r["step_s"] + r.get("log_s", 0.0) + r.get("checkpoint_s", 0.0) for r in kept)
    trained = sum(r.get("tokens", r["completion_tokens"]) for r in kept)
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in kept)  # noqa: E731
    return {
        "steps": f"{len(kept)}*" if warm else len(kept), "step_s": wall / len(kept),
        "generate_s": mean("generate_s"), "train_s": mean("train_s"),
        "tokens_per_s": trained / wall, "generated": sum(r["completion_tokens"] for r in kept) / trained,
        "tail_share": mean("gen_tail_share"), "batch_fill": mean("gen_batch_fill"),
        "balance": mean("gen_engine_balance") if "gen_engine_balance" in kept[0] else None,
        "rank_balance": mean("train_rank_balance") if "train_rank_balance" in kept[0] else None,
        "after_need": mean("gen_after_need_s") / mean("generate_s") if "gen_after_need_s" in kept[0] else None,
        "preemptions": mean("gen_preemptions"), "kv_read": mean("gen_kv_read_tb_per_s"),
        "tail_kv_read": mean("gen_tail_kv_read_tb_per_s") if "gen_tail_kv_read_tb_per_s" in kept[0] else None,
        "trainer_idle": sum(r["wait_rollouts_s"] for r in kept) / wall,
        "generator_idle": sum(r["generator_idle_s"] for r in kept) / wall,
        "response_mean": mean("response_length_mean"), "response_max": max(r["response_length_max"] for r in kept),
    }


def gpu_of(results: Path) -> str:
    """The GPU a lease's rows ran on, as its summaries name it ('' if none does)."""
    for path in sorted(results.glob("long_tail_summary_*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip() and (gpu := json.loads(line).get("gpu")):
                return gpu
    return ""


def flag_values(args: str) -> dict[str, str]:
    """The '--key value' pairs of a row's overrides."""
    words = args.split()
    return dict(zip(words[::2], words[1::2]))


def summary_values(results: Path, key: str) -> dict[str, str]:
    """Row name -> what its summary records under ``key`` (on_args: the LONG_TAIL_ON_ARGS; alloc_conf: torch's
    allocator setting), for the rows whose summaries have it (a row run twice in a lease: its last call's)."""
    got = {}
    for path in sorted(results.glob("long_tail_summary_*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip() and key in (summary := json.loads(line)):
                got[summary["layout"]] = summary[key]
    return got


def alloc_note(alloc_conf: str, *, named: bool = False) -> str:
    """" (expandable segments)" after a row run with them (run/startup.py's default since 2026-11-29) whose name
    does not say so already (``named``: its -expandable suffix)."""
    return " (expandable segments)" if "expandable_segments:True" in alloc_conf and not named else ""


def default_on_args() -> dict[str, str]:
    """partial_args.sh's PARTIAL_ON_ARGS (long_tail.sh's default LONG_TAIL_ON_ARGS) as '--key value' pairs."""
    text = PARTIAL_ARGS_SH.read_text().replace("\\\n", "")  # the shell's line continuation inside the quotes
    return flag_values(re.search(r'PARTIAL_ON_ARGS="([^"]*)"', text).group(1))


def settings_note(on_args: str | None, *, default: dict[str, str]) -> str:
    """Where a row's partial-rollout settings differ from ``default`` (default_on_args), those settings:
    " (over_sample 128)"."""
    if on_args is None:
        return ""
    changed = [f"{key.removeprefix('--').removeprefix('grpo.partial.')} {value}"
               for key, value in flag_values(on_args).items() if default.get(key) != value]
    return f" ({', '.join(changed)})" if changed else ""


def tail_numbers(results: Path) -> dict:
    """(layout, size, mode) -> the row's numbers (row_numbers) and the settings note of a row with partial rollouts
    (settings_note) and its allocator's (alloc_note), None where the folder has no such row."""
    numbers, default = {}, default_on_args()
    on_args, alloc = summary_values(results, "on_args"), summary_values(results, "alloc_conf")
    for layout in LAYOUTS:
        for size in SIZES:
            for mode in MODES:
                row = f"{layout}-{size}-{mode}"
                path = results / f"long_tail_{row}.jsonl"
                n = row_numbers(steps(path), skip=warmup(layout, mode)) if path.is_file() else None
                if n is not None:
                    partial = base_mode(mode) in PARTIAL
                    n["settings"] = ((settings_note(on_args.get(row), default=default) if partial else "")
                                     + alloc_note(alloc.get(row, ""), named=mode.endswith(EXPANDABLE)))
                numbers[layout, size, mode] = n
    return numbers


def speedup_text(n: dict, base: dict | None) -> str:
    """Trained tokens/s over the baseline's; where the row trained more tokens than it generated (generated /
    trained under 1: its steps drew on a pool over-sampled before them, which a long run cannot keep doing) also
    its generated tokens/s over the baseline's, the rate it can hold."""
    if not base:
        return "n/a"
    text = f"{n['tokens_per_s'] / base['tokens_per_s']:.2f}x"
    if n["generated"] < 0.995:
        text += f" ({n['tokens_per_s'] * n['generated'] / base['tokens_per_s']:.2f}x generated)"
    return text


def tail_table(numbers: dict) -> str:
    """One lease's rows; speed-ups against that lease's baseline only ("n/a" where it ran none)."""
    header = ["row", "layout", "steps", "step s", "generate s", "train s", "trained tokens/s", "generated / trained",
              "x sync", "tail share (after need)", "batch fill", "engine balance (trainer ranks)", "KV read TB/s (tail)",
              "preemptions", "trainer idle", "generator idle", "mean / max length"]
    rows = []
    for size in SIZES:
        for layout, where in LAYOUTS.items():
            for mode in MODES:
                n = numbers[layout, size, mode]
                name = f"{layout}-{size}-{mode}"
                if n is None:
                    continue
                base = numbers[BASELINE[layout], size, "off"]
                speedup = speedup_text(n, base)
                rows.append([name + n["settings"], where, n["steps"], f"{n['step_s']:.1f}", f"{n['generate_s']:.1f}",
                             f"{n['train_s']:.1f}", f"{n['tokens_per_s']:,.0f}", f"{n['generated']:.2f}", speedup,
                             f"{100 * n['tail_share']:.0f}%" + ("" if n["after_need"] is None else
                                                                f" ({100 * n['after_need']:.0f}%)"),
                             f"{100 * n['batch_fill']:.0f}%",
                             ("-" if n["balance"] is None else f"{100 * n['balance']:.0f}%")
                             + ("" if n["rank_balance"] is None else f" ({100 * n['rank_balance']:.0f}%)"),
                             (f"{n['kv_read']:.3g}" if n["kv_read"] else "-")
                             + ("" if n["tail_kv_read"] is None else f" ({n['tail_kv_read']:.3g})"),
                             f"{n['preemptions']:.0f}", f"{100 * n['trainer_idle']:.0f}%",
                             f"{100 * n['generator_idle']:.0f}%",
                             f"{n['response_mean']:,.0f} / {n['response_max']:,.0f}"])
    return table(header, rows) if rows else "No row has run yet.\n"


def leases_tables(folders: list[Path], *, gpu: str) -> str:
    """A table per lease folder that ran a row (a lease of profiles alone has none), then the rows none has run."""
    body, ran = "", set()
    for folder in folders:
        numbers = tail_numbers(folder)
        ran |= {key for key, n in numbers.items() if n is not None}
        if any(n is not None for n in numbers.values()) or len(folders) == 1:
            body += f"**{folder.name}** ({gpu_of(folder) or gpu or 'GPU not recorded'}):\n\n{tail_table(numbers)}\n"
    missing = [f"{layout}-{size}-{mode}" for size in SIZES for layout in LAYOUTS for mode in MODES
               if mode not in OPTIONAL and layout not in OPTIONAL_LAYOUTS and (layout, size, mode) not in ran]
    return body + (f"Not run yet: {', '.join(missing)}.\n" if missing else "")


def math_table(folders: list[Path]) -> str:
    got = {}
    for mode in MODES:
        for results in folders:
            path = results / f"long_tail_math_{mode}.jsonl"
            if path.is_file() and (lines := evals(path)):
                got[mode] = lines[-1]
    if not got:
        return "SmolLM2 math pair: not run yet.\n"
    rows = [[mode, r["step"], f"{r['eval_accuracy']:.3f} +- {r['eval_accuracy_se']:.3f}"] for mode, r in got.items()]
    body = table(["math run", "step", "held-out accuracy +- s.e."], rows)
    if "off" in got and "on" in got:
        off, on = got["off"], got["on"]
        se = math.hypot(off["eval_accuracy_se"], on["eval_accuracy_se"])
        diff = on["eval_accuracy"] - off["eval_accuracy"]
        z = diff / se if se else (0.0 if diff == 0 else math.copysign(math.inf, diff))
        verdict = "within" if abs(z) <= 2 else "NOT within"
        body += (f"\non - off = {diff:+.3f}, {z:+.2f} standard errors of the "
                 f"difference: {verdict} 2 (issue 39's bar).\n")
    return body


def trainer_table(folders: list[Path]) -> str:
    rows = []
    for kind, rows_are in (("trainer", "drawn lengths (64 x 8)"), ("trainer16k", "every row 16384 + prompt (8 x 8)")):
        for size, results, suffix in itertools.product(SIZES, folders, ("", EXPANDABLE)):
            path = results / f"long_tail_{kind}_{size}{suffix}.json"
            if not path.is_file():
                continue
            bench = json.loads(path.read_text())
            alloc = alloc_note(bench.get("alloc_conf", ""))
            for name, r in bench["results"].items():
                mfu = r.get("fwd_bwd_mfu")
                rows.append([results.name, size, rows_are, name + alloc, f"{r['tokens']:,}", peak(r, "recompute"),
                             peak(r, "fwd_bwd"), f"{r['fwd_bwd_tokens_per_s']:,.0f}",
                             f"{100 * mfu:.1f}%" if mfu is not None else "-"])
    if not rows:
        return "Trainer at long rows: not run yet.\n"
    return table(["lease", "size", "rows", "trainer setting", "tokens", "recompute peak GiB (reserved)",
                  "fwd+bwd peak GiB (reserved)", "fwd+bwd tokens/s", "fwd+bwd MFU"], rows)


def peak(result: dict, phase: str) -> str:
    """bench_trainer.py's peak of torch's tensors in ``phase`` and, where it recorded it, its allocator's reserved
    bytes (older results have none)."""
    reserved = result.get(f"{phase}_reserved_gib")
    return f"{result[f'{phase}_peak_gib']:.1f}" + (f" ({reserved:.1f})" if reserved is not None else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="one folder per machine lease")
    parser.add_argument("--gpu", default="", help="the GPU of folders whose summaries name none (nvidia-smi's name)")
    parser.add_argument("--write", action="store_true", help="replace the section in docs/benchmarks.md (here or on "
                        "the device: the numbers are the results folder's, whichever machine writes the table)")
    parser.add_argument("--write-to", type=Path, default=BENCHMARKS_MD, help="with --write: the file (default "
                        "docs/benchmarks.md; long_tail.sh: the call's own $OUT/benchmarks.md)")
    args = parser.parse_args(argv)
    body = ("Rows of scripts/gpu/long_tail.sh, a table per machine lease (speed-ups within it): "
            "run_configs/qwen3_<size>_long_tail.toml (random weights, 64 prompts x 8, log-normal response lengths, "
            f"median 1500, p90 5000, cap 8192), steps from {WARMUP} on ({WARMUP + 1} on for d and e rows with partial "
            f"rollouts; n*: a row cut before then, warm-up only). x sync: trained tokens/s over the baseline's and, "
            "where a row trained more tokens than it generated (drawing on the pool its warm-up over-sampled), by "
            f"generated tokens/s in brackets. {TARGETS}\n\n"
            + leases_tables(args.results, gpu=args.gpu) + "\n" + trainer_table(args.results) + "\n"
            + math_table(args.results))
    if args.write:
        gpus = sorted({gpu_of(folder) or args.gpu for folder in args.results} - {""})
        write_section("The long tail (cuda)", device="cuda", body=body, made_on=", ".join(gpus) or "see each lease",
                      path=args.write_to)
    else:
        print(body)


if __name__ == "__main__":
    main()
