"""scripts/gpu/long_tail_table.py's parsing on real run folders written by the loop on CPU: a harness run with
drawn lengths stands for the long-tail rows, a math run with held-out evaluations for the SmolLM2 pair, and
scripts/bench_trainer.py's JSON on cpu_tiny for the trainer rows."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, load_script, repo_env, run_cli

TABLE = REPO / "scripts" / "gpu" / "long_tail_table.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory, smollm2_dir) -> Path:
    runs, results = tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("results")
    harness = run_cli("--config", "run_configs/cpu_tiny.toml", "--trainer.steps", "3", "--job.output_dir",
                      str(runs / "tail"), "--grpo.prompts_per_step", "8", "--grpo.task_without_checkpoint", "digits",
                      "--grpo.harness_lengths.distribution", "lognormal", "--grpo.harness_lengths.median", "6",
                      "--grpo.harness_lengths.p90", "24", "--generator.sampling.max_tokens", "48")
    assert harness.returncode == 0, harness.stderr[-2000:]
    math = run_cli("--config", "run_configs/cpu_tiny.toml", "--trainer.steps", "2", "--job.output_dir",
                   str(runs / "math"), "--grpo.task", "math", "--task.tokenizer", str(smollm2_dir),
                   "--grpo.prompts_per_step", "3", "--grpo.group_size", "4", "--task.heldout_size", "8",
                   "--eval.every_n_steps", "1", "--model.max_seq_len", "128", "--generator.max_model_len", "128",
                   "--generator.sampling.max_tokens", "8")
    assert math.returncode == 0, math.stderr[-2000:]
    # the same runs under the names scripts/gpu/long_tail.sh gives its rows' results, in two lease folders
    first, second = results / "lease1", results / "lease2"
    for lease, rows in ((first, ("a-0.6B-off", "a-0.6B-on", "d-0.6B-on", "a-0.6B-onfp8", "d-0.6B-stream",
                                 "a-0.6B-onfp8-batched", "d-0.6B-stream-batched-expandable")),
                        (second, ("a-0.6B-fp8",))):
        lease.mkdir()
        for row in rows:
            shutil.copy(runs / "tail" / "latest" / "metrics.jsonl", lease / f"long_tail_{row}.jsonl")
    for mode in ("off", "on"):
        shutil.copy(runs / "math" / "latest" / "metrics.jsonl", first / f"long_tail_math_{mode}.jsonl")
    # the partial-rollout settings long_tail.sh's summaries record: the default as bash reads partial_args.sh, and
    # one row that ran with more over-sampling
    default = subprocess.run(["bash", "-c", "source scripts/gpu/partial_args.sh && echo $PARTIAL_ON_ARGS"],
                             capture_output=True, text=True, cwd=REPO, check=True).stdout.strip()
    # and the allocator setting they record: torch's own (an older row), the default since 2026-11-29 (expandable
    # segments), and a row named for it
    summaries = [{"layout": "a-0.6B-on", "on_args": default, "alloc_conf": ""},
                 {"layout": "a-0.6B-onfp8", "on_args": default.replace("over_sample 64", "over_sample 128"),
                  "alloc_conf": "expandable_segments:True"},
                 {"layout": "d-0.6B-stream-batched-expandable", "alloc_conf": "expandable_segments:True"}]
    (first / "long_tail_summary_1.jsonl").write_text("".join(json.dumps(s) + "\n" for s in summaries))
    # a trainer row as long_tail.sh runs it (bench_trainer.py's JSON) with expandable segments (bench_trainer.py's
    # default where PYTORCH_CUDA_ALLOC_CONF is unset, as simple_grpo's), the same from before the JSON named the
    # allocator's settings, and one from before it recorded reserved bytes
    expandable = first / "long_tail_trainer_0.6B-expandable.json"
    bench = subprocess.run([sys.executable, "scripts/bench_trainer.py", "--config", "run_configs/cpu_tiny.toml",
                            "--repeats", "1", "--no-write", "--variants", "chunked logprobs, 32 rows", "--json",
                            str(expandable)], capture_output=True, text=True, cwd=REPO, timeout=300,
                           env=repo_env(PYTORCH_CUDA_ALLOC_CONF=None))
    assert bench.returncode == 0, bench.stderr[-2000:]
    older = json.loads(expandable.read_text())
    assert older.pop("alloc_conf") == "expandable_segments:True"
    (first / "long_tail_trainer_0.6B.json").write_text(json.dumps(older))
    for r in older["results"].values():
        del r["recompute_reserved_gib"], r["fwd_bwd_reserved_gib"]
    (second / "long_tail_trainer16k_0.6B.json").write_text(json.dumps(older))
    return results


@pytest.mark.slow  # two CPU runs and a trainer bench in the fixture
def test_table_rows_speedups_missing_rows_and_the_math_verdict(results):
    profiles = results / "lease3"  # a lease that ran profile_generate.py alone: no table of its own
    profiles.mkdir(exist_ok=True)
    (profiles / "profile_generate.json").write_text("{}")
    proc = subprocess.run([sys.executable, str(TABLE), str(results / "lease1"), str(results / "lease2"),
                           str(profiles), "--gpu", "CPU"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "lease3" not in proc.stdout and "No row has run yet" not in proc.stdout
    first, second = proc.stdout.split("**lease2** (CPU)")
    assert "**lease1** (CPU)" in first
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in first.splitlines() if line.startswith("| a-") or line.startswith("| d-")}
    # fp8, stream, batched-noise and expandable-segments rows: shown when run; a row's settings apart from
    # partial_args.sh's, and expandable segments where its name does not say so: named
    assert set(rows) == {"a-0.6B-off", "a-0.6B-on", "d-0.6B-on",
                         "a-0.6B-onfp8 (over_sample 128) (expandable segments)", "d-0.6B-stream",
                         "a-0.6B-onfp8-batched", "d-0.6B-stream-batched-expandable"}
    # a lease compares its rows with its own baseline only: lease2 ran no a-off
    fp8 = next(line for line in second.splitlines() if line.startswith("| a-0.6B-fp8 |"))
    assert fp8.split("|")[9].strip() == "n/a"
    off = rows["a-0.6B-off"]
    assert off[1] == "2"  # steps 1 and 2 (step 0 left out)
    assert rows["d-0.6B-stream"][1] == "1"  # partial rollouts in layout d: steps 0 and 1 are its warm-up
    assert rows["d-0.6B-stream-batched-expandable"][1] == "1"  # whatever the mode's suffixes
    assert rows["a-0.6B-onfp8-batched"][7] == "1.00x"  # against a-off as today's default runs it
    assert off[6] == "1.00"  # generated / trained: without partial rollouts every sampled token trains
    assert off[7] == "1.00x" and rows["a-0.6B-on"][7] == "1.00x"  # the same run: no speed-up
    assert rows["d-0.6B-on"][7] == "n/a"  # its baseline, b-0.6B-off, has not run
    tail_share, after_need = off[8].split()
    assert int(tail_share.rstrip("%")) >= 30 and int(off[9].rstrip("%")) < 50  # lengths of median 6 up to 48: a tail
    assert after_need == "(0%)"  # no partial rollouts: nothing runs after the groups a step needs
    assert off[10] == "100%"  # one engine: nothing to wait for (engine balance)
    kv_read, tail_kv_read = off[11].split()  # the KV cache's reads a second, all and in the tail (TB/s, three
    assert float(kv_read) > 0 and float(tail_kv_read.strip("()")) > 0  # significant digits: tiny on a CPU)
    assert "Not run yet: b-0.6B-off, b-0.6B-on, d-0.6B-off, a-1.7B-off" in proc.stdout
    missing = proc.stdout.split("Not run yet:")[1].split("\n")[0]
    for optional in ("fp8", "stream", "batched", "expandable"):
        assert optional not in missing, optional  # never listed as missing
    assert "| off | 2 | " in proc.stdout and "+0.00 standard errors of the difference: within 2" in proc.stdout
    trainer = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if "| chunked logprobs, 32 rows" in line]
    assert [(r[0].strip(), r[2].strip(), r[3].strip()) for r in trainer] == [
        ("lease1", "drawn lengths (64 x 8)", "chunked logprobs, 32 rows"),
        ("lease1", "drawn lengths (64 x 8)", "chunked logprobs, 32 rows (expandable segments)"),
        ("lease2", "every row 16384 + prompt (8 x 8)", "chunked logprobs, 32 rows")]
    assert trainer[0][5].strip() == "0.0 (0.0)" and trainer[2][5].strip() == "0.0"  # on CPU no allocator counts


def test_a_row_that_trained_more_than_it_generated_is_also_compared_by_what_it_generated():
    speedup_text = load_script("scripts/gpu/long_tail_table.py").speedup_text
    base = {"tokens_per_s": 9809.0, "generated": 1.0}
    # d-1.7B-onfp8 on lease 20261129T1600_h200x2: steps 2-4 trained 3.81M tokens, generated 3.34M
    assert speedup_text({"tokens_per_s": 16370.0, "generated": 0.877}, base) == "1.67x (1.46x generated)"
    assert speedup_text({"tokens_per_s": 9809.0, "generated": 1.0}, base) == "1.00x"
    assert speedup_text({"tokens_per_s": 9000.0, "generated": 2.4}, base) == "0.92x"  # wasted tokens: trained counts
    assert speedup_text({"tokens_per_s": 9000.0, "generated": 0.9}, None) == "n/a"
