"""Held-out accuracy and mean reward of several runs on one plot, from their metrics.jsonl files.

    python scripts/plot_eval_runs.py --out docs/smollm2_math_h100.png \
        "GRPO:scripts/gpu/results/math_smollm2_h100_metrics.jsonl" \
        "no weight sync:scripts/gpu/results/math_smollm2_nosync_h100_metrics.jsonl"

A resumed run appends to its metrics file and may repeat the steps after its
last checkpoint; the record written last for a step wins.
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def load(path: str) -> tuple[dict[int, float], dict[int, float]]:
    reward, accuracy = {}, {}
    for line in open(path):
        r = json.loads(line)
        if "eval_accuracy" in r:
            accuracy[r["step"]] = r["eval_accuracy"]
        elif "reward_mean" in r:
            reward[r["step"]] = r["reward_mean"]
    return reward, accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="LABEL:path/to/metrics.jsonl")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for run in args.runs:
        label, path = run.split(":", 1)
        reward, accuracy = load(path)
        line, = top.plot(sorted(accuracy), [accuracy[s] for s in sorted(accuracy)], "o-", label=label)
        bottom.plot(sorted(reward), [reward[s] for s in sorted(reward)], color=line.get_color(), label=label)
    top.set_ylabel("held-out accuracy (greedy)")
    bottom.set_ylabel("mean reward")
    bottom.set_xlabel("step")
    top.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)


if __name__ == "__main__":
    main()
