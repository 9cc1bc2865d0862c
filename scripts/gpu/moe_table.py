"""docs/benchmarks.md "Mixture of experts (cuda)" from scripts/gpu/moe.sh's rows (metrics.jsonl, refusals)."""

import argparse
import json
import statistics
import sys
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_common import write_section  # noqa: E402

ROWS = {"small": "debugmodel_moe, 1 GPU", "small_r3": "debugmodel_moe, 1 GPU, routing replay",
        "a3b_1gpu": "Qwen3-30B-A3B shape, 1 GPU (offload, engine asleep)",
        "a3b_4gpu": "Qwen3-30B-A3B shape, 4 GPUs (FSDP, offload, engine asleep)",
        "a3b_4gpu_ep": "Qwen3-30B-A3B shape, 4 GPUs, expert parallel 4 (FSDP, offload, engine asleep)",
        "small_2gpu": "debugmodel_moe, 2 GPUs (FSDP)",
        "small_2gpu_ep": "debugmodel_moe, 2 GPUs, expert parallel 2 (FSDP)"}
SECTION = "Mixture of experts (cuda)"


def metrics(run: Path) -> list[dict]:
    files = sorted(run.glob("**/metrics.jsonl"))
    if not files:
        return []
    return [r for r in map(json.loads, files[-1].read_text().splitlines()) if "routing_mismatch" in r]


def engine(run: Path) -> str:
    """'CUDA graphs' or 'eager', from the run's saved config."""
    files = sorted(run.glob("**/config.toml"))
    if not files:
        return "?"
    eager = tomllib.loads(files[-1].read_text()).get("generator", {}).get("enforce_eager", True)
    return "eager" if eager else "CUDA graphs"


def table(res: Path, device: str) -> str:
    lines = [f"scripts/gpu/moe.sh on {device}; steps after the first (medians), raw files in "
             "scripts/gpu/results/moe/.", "",
             "Routing mismatch: the share of tokens whose top-k experts differ between the generator's forward and the "
             "trainer's recompute in any layer, then per (token, layer).", "",
             "| row | machine | engine | steps | step s | generate s | train s | sync s | routing mismatch: tokens / "
             "layers | reward first -> last | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, what in ROWS.items():
        refused, note, printed = res / f"{name}.refused", res / f"{name}.note", res / f"{name}_row.txt"
        machine = (res / f"{name}.machine").read_text().strip() if (res / f"{name}.machine").is_file() else device
        recs = metrics(res / name)
        if not recs and printed.is_file():  # the row as the device printed it, its run folder not brought back
            cells = printed.read_text().strip().split("|")[2:-1]
            lines.append(f"| {what} | {machine} |{'|'.join(cells[:-1])}| {cells[-1].strip()}: printed, no run folder |")
            continue
        if not recs:
            said = refused if refused.is_file() else note  # a note: what became of a row whose metrics are not here
            why = said.read_text().strip().splitlines()[-1] if said.is_file() else "not run"
            lines.append(f"| {what} | {machine if said.is_file() else ''} | | 0 | | | | | | | {why[:160]} |")
            continue
        later = recs[1:] or recs
        med = lambda key: statistics.median(r[key] for r in later)  # noqa: E731
        lines.append(f"| {what} | {machine} | {engine(res / name)} | {len(recs)} | {med('step_s'):.2f} | "
                     f"{med('generate_s'):.2f} | "
                     f"{med('train_s'):.2f} | {med('sync_s'):.3f} | "
                     f"{med('routing_mismatch'):.4f} / {med('routing_mismatch_layers'):.4f} | "
                     f"{recs[0]['reward_mean']:.3f} -> {recs[-1]['reward_mean']:.3f} | "
                     f"{'refused later' if refused.is_file() else 'ok'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("results", type=Path)
    p.add_argument("--device", default="?")
    p.add_argument("--write", type=Path)
    a = p.parse_args()
    body = table(a.results, a.device)
    print(body)
    if a.write:
        write_section(SECTION, device="cuda", body=body, path=a.write, made_on=a.device)
