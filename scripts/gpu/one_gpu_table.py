"""docs/benchmarks.md's "One 80 GB GPU (cuda)" section from scripts/gpu/one_gpu.sh's raw results.

    python3 scripts/gpu/one_gpu_table.py --results DIR [DIR ...] --write benchmarks.md

Reads every mission_<row>.json (scripts/gpu/mission_step.py; also one folder down, a later lease's run of a row, its
own line: MISSION_ROWS) and sizes.jsonl line (scripts/gpu/sizes_row.py) under the folders given (a row's result in
the first folder wins: the call's $OUT before the committed results) and
writes the section, between its markers,
into the file --write names (a copy of docs/benchmarks.md when it does not exist yet). Rows not run say so.
"""

import argparse
import json
import re
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NAME = "One 80 GB GPU (cuda)"
MISSION_ROWS = {
    "mission": "mission step, one GPU, first start (compile cache empty)",
    "mission_again": "mission step, one GPU, second start (compile cache kept)",
    "colocated2": "mission step, colocated on two GPUs of one host",
    "host_before_alone": "one one-GPU run alone, `--job.host_threads -1` (before)",
    "host_before_pair0": "two one-GPU runs at once, `-1` (before): GPU 0",
    "host_before_pair1": "two one-GPU runs at once, `-1` (before): GPU 1",
    "host_after_alone": "one one-GPU run alone, host threads split (after)",
    "host_after_pair0": "two one-GPU runs at once, split (after): GPU 0",
    "host_after_pair1": "two one-GPU runs at once, split (after): GPU 1",
    "mission@20261130T0025_h200": "mission step, one GPU, first start, torch's allocator as simple_grpo sets it "
                                  "(expandable segments)",
}
"""Labels of mission_<row>.json results: ``row`` for those in a folder given, ``row@SUB`` for those in its
subfolder SUB (a later lease's run of a row, kept beside the first)."""
SIZE_ROWS = {
    ("4B:a:off", "auto"): "Qwen3-4B, layout a, job.fit auto (as the README runs it)",
    ("4B:a:weights", "hand"): "Qwen3-4B, layout a, by hand: sleep weights, bfloat16 masters",
    ("8B:b:off", "auto"): "Qwen3-8B, layout b (two GPUs), job.fit auto",
    ("8B:b:weights", "hand"): "Qwen3-8B, layout b, sleep weights, bfloat16 masters",
    ("8B:b:kv_cache", "hand"): "Qwen3-8B, layout b, sleep kv_cache, bfloat16 masters",
    ("8B:b:off", "hand"): "Qwen3-8B, layout b, no sleep, bfloat16 masters",
    ("1.7B:a:off", "no_offload"): "Qwen3-1.7B, layout a, trainer state on the GPU",
    ("1.7B:a:off", "offload"): "Qwen3-1.7B, layout a, `trainer.cpu_offload true`",
}


def load(folders: list[Path]) -> tuple[dict, dict]:
    missions, sizes = {}, {}
    for folder in folders:  # later folders override earlier ones
        for path in sorted(folder.glob("mission_*.json")) + sorted(folder.glob("*/mission_*.json")):
            result = json.loads(path.read_text())
            missions[result["name"] + ("" if path.parent == folder else f"@{path.parent.name}")] = result
        sizes_file = folder / "sizes.jsonl"
        if sizes_file.is_file():
            for line in sizes_file.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    sizes[(row["row"], row.get("tag", ""))] = row
    return missions, sizes


def _machine(env: list[str]) -> str:
    return next((kv.split("=", 1)[1] for kv in env if kv.startswith("ONE_GPU_MACHINE=")), "?")


def _s(value) -> str:
    return "" if value is None else f"{value:.2f}"


def _table(header: list[str], rows: dict, results: dict, cells) -> list[str]:
    """A markdown table: one line per row (its label, then ``cells(result)``), "not run" where no result is."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, what in rows.items():
        r = results.get(key)
        got = ["not run", *[""] * (len(header) - 2)] if r is None else cells(r)
        lines.append("| " + " | ".join([what, *got]) + " |")
    return lines


def _mission_cells(r: dict) -> list[str]:
    m = r.get("median", {})
    build = f"{_s(m.get('build_s'))} ({_s(m.get('recompute_s'))})" if "build_s" in m else ""
    exit_lag = _s(r.get("exit_lag_s"))
    if r.get("output_closed_lag_s") is not None:  # rows of 2026-11-28 on: also when the last holder of its output went
        exit_lag += f" ({_s(r['output_closed_lag_s'])})"
    if r.get("returned_lag_s") is not None:  # later rows: also when main returned (the rest is os._exit's teardown)
        trained = f"{_s(r['trained_lag_s'])} / " if r.get("trained_lag_s") is not None else ""
        exit_lag += f" [{trained}{_s(r['returned_lag_s'])}]"
    return [_machine(r.get("env", [])), str(r["exit"]), _s(m.get("step_s")), _s(m.get("generate_s")),
            _s(m.get("train_s")), build, _s(m.get("sync_s")), _s(r.get("start_s")), exit_lag]


def mission_table(missions: dict) -> list[str]:
    return _table(["row", "machine", "exit", "step s", "generate s", "train s", "build s (recompute s)", "sync s",
                   "start s", "exit after last line s (output closed) [run returned / main returned]"],
                  MISSION_ROWS, missions, _mission_cells)


def _gpu(args: str) -> str:
    found = re.search(r"gpu=(.*?)(?: capped=(\S+))? wall_s=", args)
    if not found:
        return "?"
    return found.group(1) + (f", capped at {found.group(2)}" if found.group(2) else "")


def _size_cells(r: dict) -> list[str]:
    m = r.get("median", {})
    refusal = r.get("refusal") or f"exit {r['exit_code']}"
    fits = "yes" if r["fits"] else f"no: {refusal.removeprefix('torchtitan_rl: error: ').split(' (memory per GPU')[0]}"
    fit = (r.get("fit") or "").removeprefix("torchtitan_rl: job.fit auto: ").split(": the estimate")[0] or (
        "job.fit off" if "--job.fit off" in r.get("args", "") else "nothing")
    peaks = " / ".join(f"{v / 1024:.1f}" for v in (r.get("peak_gpu_mem_mib") or {}).values() if v)
    mfu = f"{100 * r['trainer_mfu']:.1f}%" if r.get("trainer_mfu") else ""
    kv = r.get("kv_tokens") or {}
    kv_cell = " / ".join(f"{kv[k]:,}" if kv.get(k) else "?" for k in ("engine", "estimate")) if kv else ""
    return [_gpu(r.get("args", "")), fits, fit, peaks, kv_cell, _s(m.get("step_s")), _s(m.get("generate_s")),
            _s(m.get("train_s")), _s(m.get("sync_s")), mfu]


def size_table(sizes: dict) -> list[str]:
    return _table(["row", "machine", "fits (or the refusal)", "what job.fit chose", "peak GiB per GPU",
                   "KV tokens (engine / estimate)", "step s",
                   "generate s", "train s", "sync s", "MFU"], SIZE_ROWS, sizes, _size_cells)


def section(missions: dict, sizes: dict) -> str:
    body = [
        f"<!-- {NAME} -->", f"## {NAME}", "",
        "- command: `ONE_GPU_ROWS='...' bash scripts/gpu/one_gpu.sh` (one device call per few rows; raw results in "
        "scripts/gpu/results/one_gpu/: mission_<row>.json, sizes.jsonl)",
        "- machine: each row names its GPU (nvidia-smi's name x the GPUs of the machine); on a card over 80 GB every "
        "process runs capped at 79.2 GiB (scripts/gpu/capped.py: the card's memory beyond it held by one allocation, "
        "the memory queries reporting 79.2 GiB; its peaks leave that allocation out); the mission rows on H200s "
        "(2026-11-28) ran under its first version, which capped torch's allocator only (vLLM sized its KV cache from "
        "the whole card: see below)",
        "",
        "run_configs/qwen3_0.6b.toml (Qwen3 shapes, random weights, 64 prompts x 8 x 256 tokens). Mission rows: medians "
        "of steps 1.. (14 steps; 6 and 8 for the second start and the host rows); start: from the command to step 0's "
        "start (imports, trainer and engine builds, compiles, CUDA graphs); exit: from the run's last line to the "
        "process's end. Size rows: medians of steps 2-5 of 6; peak: nvidia-smi every 0.5 s; MFU as in \"Sizes\".",
        "",
        "Before (issue 41, measured from outside on main as it was, one H100, 14 steps): 6.74 s a step (generate 4.41 s, "
        "train 1.81 s, sync 9 ms, ~0.5 s in none of them), more than 12 s from the last line to the exit with "
        "--generator.compile true; Qwen3-4B layout a with sleep weights estimated at 68.7 GiB of 79.2, then out of "
        "memory in step 0's train step. Targets: the mission step <= 5.0 s on one H100, <= 3.0 s colocated on two "
        "GPUs, two runs on one host within 1.1x of one alone, exit within 2 s.",
        "", *mission_table(missions), "", *size_table(sizes), "", f"<!-- /{NAME} -->", "",
    ]
    return "\n".join(body)


def write(path: Path, text: str) -> None:
    if not path.exists():
        shutil.copyfile(REPO / "docs" / "benchmarks.md", path)
    doc = path.read_text()
    pattern = re.compile(rf"<!-- {re.escape(NAME)} -->\n.*?<!-- /{re.escape(NAME)} -->\n", re.S)
    doc = pattern.sub(lambda _: text, doc) if pattern.search(doc) else doc.rstrip() + "\n\n" + text
    path.write_text(doc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", nargs="+", type=Path, required=True)
    parser.add_argument("--write", type=Path, required=True)
    args = parser.parse_args()
    missions, sizes = load(list(reversed(args.results)))
    write(args.write, section(missions, sizes))
    print(f"{NAME}: {len(missions)} mission rows, {len(sizes)} size rows -> {args.write}")


if __name__ == "__main__":
    main()
