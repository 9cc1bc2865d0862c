"""The recipe comparison's table from the runs' metrics.jsonl (scripts/gpu/research_compare.sh status).

    python scripts/gpu/research_table.py --runs /tmp/research default grpo drgrpo dapo gspo

Reads <runs>/<name>/latest/metrics.jsonl (a run folder's layout: run-N/ and the link latest). One row per
run: steps trained, each evaluation's greedy accuracy ± its standard error on the task's held-out set and
on every named set, and the median step time. A run without a metrics file yet is a row saying so.
"""

import argparse
import json
import statistics
from pathlib import Path


def read_run(folder: Path) -> tuple[list[dict], list[dict]]:
    """(training step lines, evaluation lines) of a run's metrics.jsonl; a line a kill cut short is skipped."""
    steps, evals = [], []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        (evals if any(k.startswith("eval_") for k in record) else steps).append(record)
    return steps, evals


def accuracy_columns(evals: list[dict]) -> list[str]:
    """eval_accuracy (held-out) first, then eval_accuracy/NAME of each named set."""
    keys = {k for r in evals for k in r if k.startswith("eval_accuracy") and not k.startswith("eval_accuracy_se")}
    return sorted(keys, key=lambda k: (k != "eval_accuracy", k))


def cell(record: dict, key: str) -> str:
    if key not in record:
        return "-"
    se = record.get(key.replace("eval_accuracy", "eval_accuracy_se", 1))
    return f"{record[key]:.3f}" + (f" ± {se:.3f}" if se is not None else "")


def table(runs: Path, names: list[str]) -> str:
    data = {}
    for name in names:
        folder = runs / name / "latest"
        data[name] = read_run(folder) if (folder / "metrics.jsonl").is_file() else None
    eval_steps = sorted({r["step"] for d in data.values() if d for r in d[1]})
    columns = sorted({c for d in data.values() if d for c in accuracy_columns(d[1])},
                     key=lambda k: (k != "eval_accuracy", k))
    head = ["run", "steps"] + [f"{c.partition('/')[2] or 'held-out'} @ {s}" for c in columns for s in eval_steps]
    lines = ["| " + " | ".join(head + ["median step s"]) + " |", "|" + "---|" * (len(head) + 1)]
    for name, d in data.items():
        if d is None:
            lines.append(f"| {name} | no metrics yet |")
            continue
        steps, evals = d
        at = {r["step"]: r for r in evals}
        cells = [cell(at.get(s, {}), c) for c in columns for s in eval_steps]
        median = f"{statistics.median(r['step_s'] for r in steps):.2f}" if steps else "-"
        lines.append("| " + " | ".join([name, str(len(steps)), *cells, median]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", required=True, help="the folder holding one job.output_dir per run")
    parser.add_argument("names", nargs="+")
    args = parser.parse_args()
    print(table(Path(args.runs), args.names))


if __name__ == "__main__":
    main()
