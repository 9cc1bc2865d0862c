"""What job.fit auto chooses for Qwen3 1.7B / 4B / 8B on one and two 80 GB GPUs (README, "Which layout for my model
and GPUs"): run/fit.py's ``fit`` on run_configs/qwen3_0.6b.toml with --model.flavor F, layout a (one process) and b
(colocated on both ranks), against the 79.2 GiB torch reports for an 80 GB H100. Prints the table's rows.

    python scripts/fit_table.py [--config run_configs/qwen3_0.6b.toml] [--gib 79.2]
"""

import argparse
from pathlib import Path

from torchtitan_rl.config import load_toml
from torchtitan_rl.config.checks import replace
from torchtitan_rl.models.families import resolve_shape
from torchtitan_rl.run.fit import fit
from torchtitan_rl.run.memory import GIB

REPO = Path(__file__).resolve().parents[1]


def cell(cfg, flavor: str, *, gpus: int, total: int) -> str:
    shape = resolve_shape(flavor=flavor, hf_checkpoint=None, vocab_size=0, max_seq_len=cfg.model.max_seq_len)
    try:
        result = fit(replace(cfg, "model.flavor", flavor), shape, world_size=gpus, role="colocated",
                     device_total=total)
    except ValueError:
        return "does not fit"
    peak = f"estimate {result.estimate.peak / GIB:.1f} GiB"
    if not result.changes:
        return f"as written ({peak})"
    said = ", ".join(f"`{path} {str(v).lower() if isinstance(v, bool) else v}`" for path, v in result.changes.items())
    return f"{said} ({peak})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "run_configs" / "qwen3_0.6b.toml"))
    parser.add_argument("--gib", type=float, default=79.2)
    args = parser.parse_args()
    cfg, total = load_toml(args.config), int(args.gib * GIB)
    for flavor in ("1.7B", "4B", "8B"):
        one, two = cell(cfg, flavor, gpus=1, total=total), cell(cfg, flavor, gpus=2, total=total)
        print(f"| Qwen3-{flavor} | {one} | {two} |")


if __name__ == "__main__":
    main()
