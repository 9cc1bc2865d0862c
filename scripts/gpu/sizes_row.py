"""One row of the size table (scripts/gpu/sizes.sh) from what a run left: its run folder's metrics.jsonl, its log and
nvidia-smi's memory samples. Prints one JSON line.

    python scripts/gpu/sizes_row.py --output-dir OUT_DIR --log LOG --mem MEM --row 4B:b:weights --exit-code 0 \
        [--first 2 --last 5] [--gpus 2] [--peak-tflops 989.4] [--args "..."]

OUT_DIR is the run's job.output_dir (runs write OUT_DIR/run-N/ and link OUT_DIR/latest to the newest). Step times are
medians over steps --first..--last (the first steps compile and capture graphs). Trainer MFU is 6 x matmul
parameters x tokens trained / train_s / (trainer GPUs x peak): tokens are prompt + completion tokens of the step's
rollouts, attention's own FLOPs and activation checkpointing's recompute are not counted (a lower bound).
"""

import argparse
import json
import re
import statistics
from pathlib import Path

from capped import HELD  # scripts/gpu/, beside this file
from summarize_run import metrics_file, peak_memory_mib, step_records

ESTIMATED_KV = re.compile(r"KV cache [\d.]+: (?:at most )?(\d+) tokens")
"""The memory estimate's KV-cache tokens (run/memory.py's summary; "at most" before 2026-11-28's fifth session)."""
ENGINE_KV = re.compile(r"^torchtitan_rl: generator KV cache (\d+) tokens")
"""The engine's own count, printed once it is built (Engine.capacity_line)."""
KEYS = ("step_s", "generate_s", "train_s", "sync_s", "wait_rollouts_s", "gen_tokens_per_s", "build_s", "recompute_s")


def read_log(log: Path) -> list[str]:
    """The run log's non-empty lines (a progress bar's \r ends one); none if there is no log."""
    if not log.exists():
        return []
    return [line.strip() for line in log.read_text(errors="replace").replace("\r", "\n").splitlines() if line.strip()]


def log_lines(lines: list[str]) -> tuple[str | None, str | None, str | None]:
    """(the memory estimate line, job.fit auto's line, the line that ended the run: torchtitan_rl's one-line error or
    a traceback's last)."""
    estimate = next((line for line in lines if line.startswith("torchtitan_rl: memory per")), None)
    fit = next((line for line in lines if line.startswith("torchtitan_rl: job.fit auto:")), None)
    # Ours first (one process: "torchtitan_rl: error: ..."; torchrun: "... error: rank R: ..." or "... rank R
    # failed: ..."), then a traceback's last line; torchrun's own ChildFailedError report says less.
    ours = [line for line in lines if line.startswith(("torchtitan_rl: error:", "torchtitan_rl: rank "))]
    others = [line for line in lines if "Error:" in line.split(" ")[0] and "ChildFailedError" not in line]
    errors = ours or others
    return estimate, fit, errors[-1] if errors else None


def kv_tokens(lines: list[str]) -> dict:
    """The KV cache's tokens: the estimate's and the engine's (None where the log lacks the line)."""
    estimate = next((int(m.group(1)) for line in lines if line.startswith("torchtitan_rl: memory per")
                     and (m := ESTIMATED_KV.search(line))), None)
    engine = next((int(m.group(1)) for line in lines if (m := ENGINE_KV.match(line))), None)
    return {"estimate": estimate, "engine": engine}


def held_mib(lines: list[str]) -> int:
    """MiB scripts/gpu/capped.py held on each GPU beyond the cap (0 uncapped): left out of the row's peaks."""
    return max((int(m.group(1)) for line in lines if (m := HELD.match(line))), default=0)


def matmul_params(flavor: str, vocab_size: int = 0) -> int:
    """Parameters in matmuls: all of them, less an untied embedding (a lookup)."""
    from torchtitan_rl.run.memory import count_parameters
    from torchtitan_rl.models.families import resolve_shape

    shape = resolve_shape(flavor=flavor, hf_checkpoint=None, vocab_size=vocab_size, max_seq_len=512)
    total = count_parameters(shape)[0]
    return total if shape.tie_word_embeddings else total - shape.vocab_size * shape.hidden_size


def summarize(*, output_dir: Path, log: Path, mem: Path, row: str, exit_code: int, first: int, last: int,
              trainer_gpus: int, peak_tflops: float, args: str = "", prompt_tokens: float | None = None,
              vocab_size: int = 0, gpus: list[int] = (0, 1), tag: str = "") -> dict:
    flavor, layout, sleep = row.split(":")
    records = step_records(metrics_file(output_dir))
    kept = [r for r in records if first <= r["step"] <= last] or records
    lines = read_log(log)
    estimate, fit, error = log_lines(lines)
    held = held_mib(lines)
    out = {
        "row": row, "tag": tag, "flavor": flavor, "layout": layout, "sleep": sleep, "args": args,
        "exit_code": exit_code,
        "fits": exit_code == 0 and bool(records), "refusal": error if exit_code else None, "estimate": estimate,
        "fit": fit,
        "steps_logged": len(records), "median_steps": [first, last],
        "peak_gpu_mem_mib": {g: max(0, mib - held) for g, mib in peak_memory_mib(mem, gpus).items()},
        "held_mib": held,
        "kv_tokens": kv_tokens(lines),
        "median": {k: statistics.median(r[k] for r in kept) for k in KEYS if kept and k in kept[0]},
        "trainer_mfu": None,
    }
    if kept:
        tokens = statistics.median(r["completion_tokens"] for r in kept) + (prompt_tokens or 0.0)
        train_s = out["median"]["train_s"]
        out["tokens_per_step"] = tokens
        try:
            params = matmul_params(flavor, vocab_size)
        except ValueError as e:  # a flavor whose vocabulary is the task's (tiny): --vocab-size
            out["trainer_mfu_missing"] = str(e)
        else:
            if train_s > 0:
                out["trainer_mfu"] = 6 * params * tokens / train_s / (trainer_gpus * peak_tflops * 1e12)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--log", type=Path, required=True)
    p.add_argument("--mem", type=Path, required=True)
    p.add_argument("--row", required=True, help="flavor:layout:sleep, e.g. 4B:b:weights")
    p.add_argument("--exit-code", type=int, required=True)
    p.add_argument("--first", type=int, default=2)
    p.add_argument("--last", type=int, default=5)
    p.add_argument("--trainer-gpus", type=int, default=1)
    p.add_argument("--peak-tflops", type=float, default=989.4, help="dense bf16 of one GPU (H100/H200 SXM)")
    p.add_argument("--prompt-tokens", type=float, default=None, help="prompt tokens per step, added to the count")
    p.add_argument("--args", default="")
    p.add_argument("--gpus", default="0,1", help="the GPU indices the run used (their peaks only)")
    p.add_argument("--vocab-size", type=int, default=0, help="for flavors without one (tiny: the task's)")
    p.add_argument("--tag", default="", help="names the row among rows of one FLAVOR:LAYOUT:SLEEP (e.g. auto, hand)")
    a = p.parse_args()
    print(json.dumps(summarize(output_dir=a.output_dir, log=a.log, mem=a.mem, row=a.row, exit_code=a.exit_code,
                               first=a.first, last=a.last, trainer_gpus=a.trainer_gpus, peak_tflops=a.peak_tflops,
                               args=a.args, prompt_tokens=a.prompt_tokens, vocab_size=a.vocab_size,
                               gpus=[int(g) for g in a.gpus.split(",")], tag=a.tag)))


if __name__ == "__main__":
    main()
