"""The GRPO loop end to end on the default CPU config: real vLLM engine, real trainer.

Each test builds its own engine in this process (seconds on CPU). The config
is deterministic on CPU (seeded per-request sampling, deterministic trainer
kernels), so these runs give the same numbers every time; the thresholds
leave margin for other kernels or thread counts.
"""

import gc
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from tests.helpers import BF16_MISMATCH_MEAN, assert_one_line_error, not_measured, repo_env, run_cli
from torchtitan_rl import simple_grpo
from torchtitan_rl.config import JobConfig, load_toml, validate
from torchtitan_rl.rollout.base import Rollouts
from torchtitan_rl.rollout.queue import check_queued

CPU_TINY = Path(__file__).resolve().parents[1] / "run_configs" / "cpu_tiny.toml"

STEPS = 40
"""Long enough to learn. Mean reward, first 5 -> last 5 steps: seed 0 0.077 -> 0.590,
seed 1 0.088 -> 0.654; without weight sync (seed 0) 0.053 -> 0.054."""
RANDOM_POLICY_REWARD = 0.06
"""About 1/16 (vocab size): one in sixteen digits right by chance."""


def _config(output_dir: Path, *, steps: int) -> JobConfig:
    cfg = load_toml(CPU_TINY)
    cfg.job.output_dir = str(output_dir)
    cfg.trainer.steps = steps
    return cfg


def train(cfg: JobConfig) -> list[dict]:
    """simple_grpo.train, with a garbage collection in between runs.

    vLLM's engine shutdown used to destroy the default process group (the
    trainer's) when a dropped engine was collected; compat keeps it now, and
    collecting here makes any regression of that show up at once.
    """
    history = simple_grpo.train(cfg)
    gc.collect()
    return history


def _mean_reward(history: list[dict]) -> float:
    return sum(r["reward_mean"] for r in history) / len(history)


@pytest.mark.slow
def test_short_run_learns(tmp_path):
    cfg = _config(tmp_path, steps=STEPS)
    validate(cfg)
    history = train(cfg)

    assert [r["step"] for r in history] == list(range(STEPS))
    # Step N samples with the weights after N optimizer steps.
    assert [r["weight_version"] for r in history] == list(range(STEPS))
    first, last = _mean_reward(history[:5]), _mean_reward(history[-5:])
    assert first < 0.15, first  # the random policy
    assert last > 0.3 and last > first + 0.2, (first, last)
    # Trainer and generator score the sampled tokens alike at every step.
    assert max(r["mismatch_mean"] for r in history) < BF16_MISMATCH_MEAN
    # What each phase held (run/memory_watch.py; on CPU the process's resident memory: torch and vLLM at least).
    assert all({k for k in r if k.startswith("mem_")} == {"mem_generate_gib", "mem_recompute_gib", "mem_train_gib"}
               and min(r[k] for k in r if k.startswith("mem_")) > 0.2 for r in history)

    # What a user looks at afterwards, in the run's own folder.
    run_dir = tmp_path / "run-1"
    assert (tmp_path / "latest").resolve() == run_dir.resolve()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == history
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    png = run_dir / "reward_and_mismatch.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert load_toml(run_dir / "config.toml") == cfg


@pytest.mark.slow
def test_pi_old_from_the_training_forward_trains_as_the_recompute_does(tmp_path):
    """grpo.old_logprobs train through the loop: no recompute, the same samples and steps, the mismatch and ratio
    metrics measured on the training forward under the same names."""
    runs = {}
    for mode in ("recompute", "train"):
        cfg = _config(tmp_path / mode, steps=3)
        cfg.grpo.old_logprobs = mode
        runs[mode] = train(cfg)
    for got, want in zip(runs["train"], runs["recompute"], strict=True):
        assert got.keys() == want.keys()  # the measured metrics keep their names
        assert got["ratio_mean"] == 1.0 and got["clip_fraction"] == 0.0  # pi / pi_old of one forward
        # 0 where the generator's and the trainer's bf16 kernels agree bit for bit (seen on an AMX CPU)
        assert 0 <= got["mismatch_mean"] < BF16_MISMATCH_MEAN and got["is_weight_mean"] == pytest.approx(1, abs=0.01)
        assert got["recompute_s"] < 0.01  # nothing ran (the reference's KL is off)
    # Step 0 samples from the same weights: the same rollouts. Its step differs from the recompute's only by
    # the bf16 gap between two forwards of other batch shapes (tests/trainer: equal on fp32).
    got, want = runs["train"][0], runs["recompute"][0]
    assert (got["reward_mean"], got["completion_tokens"]) == (want["reward_mean"], want["completion_tokens"])
    assert got["loss"] == pytest.approx(want["loss"], rel=0.05)


@pytest.mark.slow
def test_without_weight_sync_the_run_does_not_learn(tmp_path):
    cfg = _config(tmp_path, steps=STEPS)
    cfg.weight_sync.enable = False
    history = train(cfg)

    # Only the first sync happens: the generator serves step-0 weights throughout.
    assert [r["weight_version"] for r in history] == [0] * STEPS
    assert _mean_reward(history[-5:]) < 2 * RANDOM_POLICY_REWARD
    # Not because the trainer stood still: it moved away from the generator.
    assert history[0]["mismatch_mean"] < BF16_MISMATCH_MEAN
    assert history[-1]["mismatch_mean"] > 20 * BF16_MISMATCH_MEAN


def _moe(cfg: JobConfig) -> JobConfig:
    """The tiny MoE with routing replay and load balancing on: the routing bias and the replayed routes must
    resume too."""
    cfg.model.flavor = "tiny-moe"
    cfg.model.moe_load_balance_coeff = 1e-2
    cfg.grpo.routing_replay = True
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_resume_matches_uninterrupted_run(tmp_path, moe):
    model = _moe if moe else (lambda cfg: cfg)
    a = train(model(_config(tmp_path / "a", steps=6)))

    first = model(_config(tmp_path / "b", steps=3))
    first.trainer.checkpoint.enable = True
    first.trainer.checkpoint.interval = 3
    train(first)
    assert (tmp_path / "b" / "latest" / "checkpoints" / "step-3").is_dir()
    second = model(_config(tmp_path / "b", steps=6))
    second.trainer.checkpoint.enable = True
    second.trainer.checkpoint.interval = 3
    second.resume = True
    b = train(second)

    assert [r["step"] for r in b] == [3, 4, 5]
    # The resumed generator starts from the checkpoint's weights, not from scratch.
    assert [r["weight_version"] for r in b] == [3, 4, 5]
    # Same prompts, same samples, same trainer state: every metric bit for bit.
    for got, want in zip(_not_measured(b), _not_measured(a[3:]), strict=True):
        assert got == want, {k: (got.get(k), want.get(k)) for k in got.keys() | want.keys()
                             if got.get(k) != want.get(k)}
    if moe:  # the generator's expert choices vs the trainer's, measured every step
        assert all(r["routing_tokens"] > 0 and "routing_mismatch" in r for r in a)
    # The resumed run continues its run's folder and metrics file.
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["latest", "run-1"]
    lines = (tmp_path / "b" / "latest" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(6))


def _partial_config(output_dir: Path, *, steps: int) -> JobConfig:
    """cpu_tiny with partial rollouts: 8 groups over-sampled, a generate stops once 32 are finished."""
    cfg = _config(output_dir, steps=steps)
    cfg.grpo.partial.enable, cfg.grpo.partial.over_sample = True, 8
    cfg.grpo.importance_correction = "truncate"
    cfg.trainer.checkpoint.enable, cfg.trainer.checkpoint.interval = True, 3
    return cfg


def _not_measured(history: list[dict]) -> list[dict]:
    return [not_measured(r) for r in history]


@pytest.mark.slow
def test_partial_rollouts_resume_from_unfinished_samples_gives_the_uninterrupted_run(tmp_path):
    a = train(_partial_config(tmp_path / "a", steps=6))
    # Samples were cut and carried, and tokens of the version before trained.
    assert all(r["partial_carried_samples"] > 0 for r in a) and all(r["version_age_1_frac"] > 0 for r in a[1:])
    assert [r["weight_version"] for r in a] == list(range(6)) and max(r["version_age_max"] for r in a) == 1
    # The checkpoint after step 2 is in step 3's line, outside any step_s (an async layout's waits for rollouts too).
    assert a[3]["checkpoint_s"] > 0 and [r["checkpoint_s"] for i, r in enumerate(a) if i != 3] == [0.0] * 5

    train(_partial_config(tmp_path / "b", steps=3))
    saved = dcp_extra(tmp_path / "b" / "latest" / "checkpoints" / "step-3")
    assert any(f is False for g in saved["partial"]["groups"] for f in g.so_far.finished)  # unfinished samples
    second = _partial_config(tmp_path / "b", steps=6)
    second.resume = True
    b = train(second)
    # Every metric of the resumed steps, bit for bit: the carried samples continued as they would have.
    assert _not_measured(b) == _not_measured(a[3:])
    # The same seed and layout give the same samples (here: the first three steps of two runs).
    c = train(_partial_config(tmp_path / "c", steps=3))
    assert _not_measured(c) == _not_measured(a[:3])


@pytest.mark.slow
def test_generation_overlapped_with_training_gives_the_same_run_and_resumes_bit_for_bit(tmp_path):
    # grpo.max_staleness 1 with partial rollouts: with generator.overlap_training the engine's thread generates
    # request k + 1 while step k trains; the same requests with the same weights as generating first, so every
    # metric bit for bit, and through a checkpoint that took request 3 from the thread (steps 3-4 again).
    def config(folder: Path, overlap: bool) -> JobConfig:
        cfg = _partial_config(folder, steps=5)
        cfg.grpo.max_staleness, cfg.grpo.partial.max_token_age = 1, 3
        cfg.generator.overlap_training = overlap
        validate(cfg)
        return cfg

    a = train(config(tmp_path / "a", False))
    b = train(config(tmp_path / "b", True))
    resumed = config(tmp_path / "b", True)
    resumed.resume = True
    again = train(resumed)
    assert [r["weight_version"] for r in b] == [0, 0, 1, 2, 3] and [r["step"] for r in again] == [3, 4]
    assert _not_measured(b) == _not_measured(a) and _not_measured(again) == _not_measured(a[3:])


def dcp_extra(checkpoint: Path) -> dict:
    """The ``extra`` a checkpoint saved (the rollout queue's state), read as trainer/checkpoint.py's load does."""
    head = {"trainer": b""}
    dcp.load(head, checkpoint_id=checkpoint)
    return pickle.loads(head["trainer"])["extra"]


def test_resume_refuses_queued_rollouts_older_than_the_staleness_bound():
    # A checkpoint of a max_staleness 1 run holds step 5's rollouts, sampled with version 4.
    queued = [(5, [], Rollouts([[1]], [[2]], [[-0.5]], weight_version=4))]
    cfg = load_toml(CPU_TINY)
    cfg.grpo.max_staleness = 1
    check_queued(cfg, queued)
    cfg.grpo.max_staleness = 0
    with pytest.raises(ValueError, match=r"grpo.max_staleness: the checkpoint holds rollouts for steps \[5\]"):
        check_queued(cfg, queued)


@pytest.mark.slow  # three steps of a whole run: ~16 s on an AVX2-only CPU, out of the quick loop
def test_batch_invariant_run_has_zero_differing_tokens_every_step(tmp_path):
    cfg = _config(tmp_path, steps=3)
    cfg.batch_invariant_mode = True
    cfg.grpo.prompts_per_step = 8
    validate(cfg)
    history = train(cfg)
    assert [r["mismatch_frac_tokens"] for r in history] == [0.0, 0.0, 0.0]
    assert all(r["mismatch_max"] == 0.0 for r in history)
    assert all(0 <= r["gen_tail_share"] <= 1 and r["gen_iterations"] >= 4 for r in history)  # every run logs it


@pytest.mark.slow  # a timing-harness run of drawn lengths up to 48 tokens: ~15 s on 2 cores
def test_harness_run_with_drawn_lengths_logs_their_tail(tmp_path):
    cfg = _config(tmp_path, steps=2)
    cfg.grpo.task_without_checkpoint = "digits"  # the timing harness: random weights, no checkpoint
    cfg.grpo.harness_lengths.distribution = "lognormal"
    cfg.grpo.harness_lengths.median, cfg.grpo.harness_lengths.p90 = 6, 24
    cfg.generator.sampling.max_tokens = 48
    cfg.grpo.prompts_per_step = 8
    validate(cfg)
    history = train(cfg)
    for r in history:
        # 64 samples of median 6: the few long ones decode alone through most of the generate's steps (counted in
        # steps: the tail's share of the time depends on how a CPU's step cost grows with the batch)
        assert r["response_length_max"] >= 24 and 4 <= r["response_length_mean"] <= 16
        assert r["gen_iterations"] >= r["response_length_max"] and r["gen_tail_iterations"] > r["gen_iterations"] / 2
        assert 0 < r["gen_tail_share"] < 1
        assert r["gen_batch_fill"] < 0.5 and r["gen_preemptions"] == 0


# ------------------------------------------- tasks on a real tokenizer, held-out evaluation


def _chat_config(output_dir: Path, tokenizer_dir: Path, *, steps: int, task: str = "math", **task_fields) -> JobConfig:
    """The tiny random Qwen3 on SmolLM2's tokenizer (49152 ids) and chat template: small and fast,
    it answers nothing right, but its samples, logprobs and the loop's bookkeeping are real."""
    cfg = _config(output_dir, steps=steps)
    cfg.grpo.task = task
    cfg.grpo.prompts_per_step, cfg.grpo.group_size = 3, 4
    cfg.task.tokenizer = str(tokenizer_dir)
    cfg.task.heldout_size = 8
    for name, value in task_fields.items():
        setattr(cfg.task, name, value)
    cfg.model.max_seq_len = cfg.generator.max_model_len = 128
    cfg.generator.sampling.max_tokens = 8
    validate(cfg)
    return cfg


def _training_metrics(history: list[dict]) -> list[tuple]:
    # mismatch_mean and tokens change with any sampled token; the tiny model's rewards are all 0.
    return [(r["step"], r["reward_mean"], r["loss"], r["grad_norm"], r["mismatch_mean"], r["tokens"]) for r in history]


@pytest.mark.slow  # a whole run or engine in its own process: 7-12 s, out of the quick loop
def test_heldout_evaluation_does_not_change_the_training_samples(tmp_path, smollm2_dir):
    off = train(_chat_config(tmp_path / "off", smollm2_dir, steps=3))
    cfg = _chat_config(tmp_path / "on", smollm2_dir, steps=3)
    cfg.eval.every_n_steps, cfg.eval.mean_at_k = 2, 2
    on = train(cfg)

    assert _training_metrics(on) == _training_metrics(off)
    assert {r["mismatch_mean"] for r in on} != {0.0}  # the comparison has something to compare
    evals = [json.loads(line) for line in (tmp_path / "on" / "latest" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if "eval_accuracy" in r]
    # Before the first step, every 2 steps, and after the last (one more sync).
    assert [(r["step"], r["eval_weight_version"]) for r in evals] == [(0, 0), (2, 2), (3, 3)]
    assert all(r["eval_prompts"] == 8 and 0 <= r["eval_accuracy"] <= 1 and "eval_mean_at_2" in r for r in evals)
    assert not (tmp_path / "off" / "latest" / "metrics.jsonl").read_text().count("eval_")


@pytest.mark.slow
def test_resumes_log_each_step_evaluation_and_sample_once_and_export_again(tmp_path, smollm2_dir):
    def config(steps: int, resume: bool) -> JobConfig:
        cfg = _chat_config(tmp_path, smollm2_dir, steps=steps)
        cfg.eval.every_n_steps, cfg.metrics.samples_per_eval, cfg.job.export = 2, 2, True
        cfg.trainer.checkpoint.enable, cfg.trainer.checkpoint.interval, cfg.resume = True, 2, resume
        return cfg

    train(config(2, False))
    train(config(4, True))  # resumed at step 2, an evaluation step: its evaluation runs again
    train(config(4, True))  # resumed at step 4, a finished run: only the final evaluation and the export run again
    folder = tmp_path / "run-1"
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "eval_accuracy" not in r] == [0, 1, 2, 3]
    assert [r["step"] for r in lines if "eval_accuracy" in r] == [0, 2, 4]
    samples = [json.loads(line)["step"] for line in (folder / "samples.jsonl").read_text().splitlines()]
    assert samples == [0, 0, 2, 2, 4, 4]
    assert (folder / "hf" / "model.safetensors").is_file()  # each end of the run exported; the earlier set aside
    assert {p.name for p in folder.iterdir() if p.name.startswith("hf.")} == {
        "hf.before-resume-at-step-2", "hf.before-resume-at-step-4"}


@pytest.mark.slow  # torchrun start-up and a real engine: 13-15 s
def test_dataset_resume_draws_the_prompts_of_an_uninterrupted_run(tmp_path, smollm2_dir):
    # 10 problems, 2 held out: 8 per epoch at 3 prompts per step, so the resumed
    # step 2 finishes epoch 1 (order from the checkpoint) and starts epoch 2.
    rows = [{"question": f"What is {i} + {i + 1}?", "answer": f"#### {2 * i + 1}"} for i in range(10)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def config(name: str, steps: int) -> JobConfig:
        cfg = _chat_config(tmp_path / name, smollm2_dir, steps=steps, task="dataset", path=str(data),
                           heldout_fraction=0.2)
        cfg.trainer.checkpoint.enable, cfg.trainer.checkpoint.interval = True, 2
        return cfg

    a = train(config("a", 4))
    train(config("b", 2))
    resumed = config("b", 4)
    resumed.resume = True
    b = train(resumed)
    assert [r["step"] for r in b] == [2, 3]
    assert _training_metrics(b) == _training_metrics(a[2:])


@pytest.mark.slow
def test_dynamic_sampling_refills_leave_the_dataset_epoch_position_alone(tmp_path, smollm2_dir):
    rows = [{"question": f"What is {i} + {i + 1}?", "answer": f"#### {2 * i + 1}"} for i in range(10)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _chat_config(tmp_path / "out", smollm2_dir, steps=2, task="dataset", path=str(data), heldout_fraction=0.2)
    cfg.grpo.dynamic_sampling, cfg.grpo.dynamic_sampling_max_rounds = True, 1
    cfg.trainer.checkpoint.enable, cfg.trainer.checkpoint.interval = True, 2
    history = train(cfg)
    assert all(r["sampling_rounds"] == 1 for r in history)  # the random model's rewards are equal: refills ran
    head = {"trainer": b""}
    dcp.load(head, checkpoint_id=tmp_path / "out" / "latest" / "checkpoints" / "step-2")
    task = pickle.loads(head["trainer"])["extra"]["task"]
    # the main stream drew 2 steps x 3 of the 8 training records; the refills' 6 prompts moved nothing
    assert (task["epoch"], task["position"], task["num_train"]) == (1, 6, 8)


@pytest.mark.slow  # a whole run's start up to the dataset: ~8 s
def test_cli_bad_dataset_line_is_one_line_and_exit_2(tmp_path, smollm2_dir):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n{"question": \n')
    proc = run_cli("--grpo.task", "dataset", "--task.tokenizer", str(smollm2_dir), "--task.path", str(data),
                   "--job.output_dir", str(tmp_path / "out"))
    assert_one_line_error(proc, f"task.path: {data}:2: invalid JSON", prefix="torchtitan_rl: error: ")


def test_cli_digits_on_a_pretrained_checkpoint_is_one_line_and_exit_2(tmp_path, smollm2_dir):
    proc = run_cli("--model.hf_checkpoint", str(smollm2_dir), "--job.output_dir", str(tmp_path))
    assert_one_line_error(
        proc, "grpo.task 'digits': its tokenizer (16 token ids) is not the tokenizer of model.hf_checkpoint",
        prefix="torchtitan_rl: error: ",
    )


def test_a_run_gives_torch_expandable_segments_before_importing_it_unless_the_environment_says_otherwise(tmp_path):
    """run/startup.py's CUDA_ALLOC_CONF: torch reads PYTORCH_CUDA_ALLOC_CONF once, so simple_grpo sets it before
    torch is imported (and its ranks' and engine's processes inherit it); one the user set, even empty, stays."""
    code = ("import os, sys; from torchtitan_rl import simple_grpo; assert 'torch' not in sys.modules; "
            "simple_grpo.main(sys.argv[1:]); print(repr(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))); "
            "os.environ['PYTORCH_CUDA_ALLOC_CONF'] = ''; "
            "simple_grpo.main(sys.argv[1:]); print(repr(os.environ.get('PYTORCH_CUDA_ALLOC_CONF')))")
    proc = subprocess.run([sys.executable, "-c", code, "--config", str(CPU_TINY), "--job.output_dir", str(tmp_path),
                           "--dry-run"], env=repo_env(PYTORCH_CUDA_ALLOC_CONF=None), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = [line for line in proc.stdout.splitlines() if not line.startswith("torchtitan_rl:")]
    assert printed == ["'expandable_segments:True'", "''"], proc.stdout
