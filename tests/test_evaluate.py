"""Named evaluation sets in the loop and in the standalone evaluator: the same weights score the same."""

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import assert_one_line_error, run_module
from tests.test_simple_grpo import _chat_config, train
from torchtitan_rl.config import EvalSetConfig, load_toml

REPO = Path(__file__).resolve().parents[1]
WORD_PROBLEMS = REPO / "torchtitan_rl" / "grpo" / "tasks" / "data" / "word_problems_eval.jsonl"


def _evals(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if any(k.startswith("eval_") for k in r)]


def _samples(run_dir: Path, step: int, name: str) -> list[tuple[str, str, bool]]:
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return [(r["prompt"], r["completion"], r["correct"]) for r in rows if r["step"] == step and r["set"] == name]


def _report_problems(report: dict, name: str) -> list[tuple[str, str, bool]]:
    return [(p["prompt"], p["completion"], p["correct"]) for p in report["sets"][name]["problems"]]


@pytest.mark.slow  # a 1-step run, its export, and two evaluator runs with their own engines: ~60 s
def test_a_runs_export_and_checkpoint_score_in_the_evaluator_what_the_loops_final_evaluation_logged(
        tmp_path, smollm2_dir):
    cfg = _chat_config(tmp_path / "out", smollm2_dir, steps=1)
    # Prompts of this set take up to ~90 tokens in SmolLM2's template, answers 16.
    cfg.model.max_seq_len = cfg.generator.max_model_len = 160
    cfg.eval.every_n_steps, cfg.metrics.samples_per_eval = 1, 6
    cfg.eval.sets = (EvalSetConfig(name="words", path=str(WORD_PROBLEMS), num_prompts=6, max_tokens=16),
                     EvalSetConfig(name="sample", path=str(REPO / "torchtitan_rl/grpo/tasks/data/gsm8k_style_sample.jsonl"),
                                   num_prompts=4, max_tokens=12, instruction="Answer with a number."))
    cfg.job.export = True
    cfg.trainer.checkpoint.enable, cfg.trainer.checkpoint.interval = True, 1
    train(cfg)
    folder = tmp_path / "out" / "latest"
    final = _evals(folder)[-1]
    assert final["step"] == 1 and final["eval_prompts/words"] == 6 and final["eval_prompts/sample"] == 4
    assert {"eval_accuracy", "eval_accuracy_se", "eval_accuracy/words", "eval_accuracy_se/words"} <= set(final)
    # The run's config keeps the sets as [[eval.sets]] tables.
    assert load_toml(folder / "config.toml").eval.sets == cfg.eval.sets

    exported = run_module("torchtitan_rl.evaluate", "--model", str(folder / "hf"), "--dtype", "bfloat16",
                          "--set", f"words={WORD_PROBLEMS}", "--num-prompts", "6", "--max-tokens", "16",
                          "--max-model-len", "160", "--kv-cache-gb", "0.25", "--device", "cpu",
                          "--out", str(tmp_path / "hf.json"), timeout=300)
    assert exported.returncode == 0, exported.stderr
    from_checkpoint = run_module("torchtitan_rl.evaluate", "--run-dir", str(tmp_path / "out"), "--step", "1",
                                 "--out", str(tmp_path / "ckpt.json"), timeout=300)
    assert from_checkpoint.returncode == 0, from_checkpoint.stderr
    # The run's own export, scored with the run's settings (its held-out set included).
    own = run_module("torchtitan_rl.evaluate", "--run-dir", str(folder), "--model", str(folder / "hf"),
                     "--out", str(tmp_path / "own.json"), timeout=300)
    assert own.returncode == 0, own.stderr
    a = json.loads((tmp_path / "hf.json").read_text())
    b = json.loads((tmp_path / "ckpt.json").read_text())
    c = json.loads((tmp_path / "own.json").read_text())
    for name in ("words",):
        # Same prompts, same greedy completions, same verdicts as the loop's final evaluation.
        assert _report_problems(a, name) == _samples(folder, 1, name)
        assert a["metrics"][f"eval_accuracy/{name}"] == final[f"eval_accuracy/{name}"]
    for report in (b, c):
        for name in ("words", "sample", "heldout"):  # the run's own sets and settings (its instruction for 'sample')
            logged = _samples(folder, 1, name)  # the first samples_per_eval of each set
            assert logged and _report_problems(report, name)[: len(logged)] == logged
            key = "eval_accuracy" + ("" if name == "heldout" else f"/{name}")
            assert report["metrics"][key] == report["sets"][name]["accuracy"] == final[key]
        assert report["sets"]["heldout"]["prompts"] == final["eval_prompts"] == 8
        assert "Answer with a number." in report["sets"]["sample"]["problems"][0]["prompt"]
    assert "heldout" not in a["sets"]  # a folder alone has no task


EASY = [("What is 2 + 2?", "4"), ("What is 1 + 1?", "2"), ("What is 3 + 3?", "6"), ("What is 10 + 10?", "20"),
        ("What is 5 + 5?", "10"), ("What is 2 + 3?", "5")]
"""SmolLM2-135M-Instruct answers 2 of these 6 right at 24 tokens, greedy, fp32, CPU (1 + 1 and 10 + 10)."""


@pytest.mark.slow  # SmolLM2-135M in fp32 on CPU: the trainer, a step and two engines, minutes
def test_smollm2_scores_the_same_in_the_loop_before_step_0_and_in_the_evaluator(tmp_path, smollm2_dir):
    easy = tmp_path / "easy.jsonl"
    easy.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in EASY))
    cfg = load_toml(REPO / "run_configs" / "smollm2_135m_math_cpu.toml")
    cfg.job.output_dir, cfg.model.hf_checkpoint = str(tmp_path / "out"), str(smollm2_dir)
    cfg.trainer.steps, cfg.grpo.prompts_per_step, cfg.grpo.group_size = 1, 1, 2
    cfg.generator.sampling.max_tokens = 8
    cfg.eval.every_n_steps, cfg.eval.num_prompts, cfg.eval.max_tokens, cfg.metrics.samples_per_eval = 1, 1, 24, 6
    cfg.eval.sets = (EvalSetConfig(name="easy", path=str(easy), instruction="Answer with just the number."),)
    train(cfg)
    folder = tmp_path / "out" / "latest"
    before = _evals(folder)[0]
    assert before["step"] == 0
    proc = run_module("torchtitan_rl.evaluate", "--model", str(smollm2_dir), "--dtype", "float32",
                      "--set", f"easy={easy}", "--instruction", "Answer with just the number.", "--max-tokens", "24",
                      "--max-model-len", "192", "--kv-cache-gb", "0.5", "--device", "cpu",
                      "--out", str(tmp_path / "base.json"), timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "base.json").read_text())
    assert _report_problems(report, "easy") == _samples(folder, 0, "easy")
    assert report["metrics"]["eval_accuracy/easy"] == before["eval_accuracy/easy"] > 0  # it solves some


@pytest.mark.slow  # a whole process's imports and start-up: 6-8 s, out of the quick loop
def test_evaluator_refuses_a_set_without_the_answer_field_in_one_line(tmp_path, smollm2_dir):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "What is 1 + 1?", "solution": "2"}\n')
    proc = run_module("torchtitan_rl.evaluate", "--model", str(smollm2_dir), "--set", f"bad={data}",
                      "--device", "cpu")
    assert_one_line_error(proc, f"--set bad.answer_field: {data}:1 has no field 'answer'",
                          prefix="torchtitan_rl: error: ")


@pytest.mark.slow  # a whole process's imports and start-up: 6-8 s, out of the quick loop
def test_evaluator_refuses_a_folder_without_weights_in_one_line(tmp_path, smollm2_dir):
    """config.json and the tokenizer but no *.safetensors: the trainer's own check (models/hf_folder.py), one
    line and exit 2 (before: vLLM's "Cannot find any model weights" in an 81-line traceback, exit 1)."""
    folder = tmp_path / "no_weights"
    folder.mkdir()
    for file in smollm2_dir.iterdir():
        if file.is_file() and file.suffix != ".safetensors":
            shutil.copy(file, folder)
    data = tmp_path / "set.jsonl"
    data.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n')
    proc = run_module("torchtitan_rl.evaluate", "--model", str(folder), "--set", f"easy={data}", "--device", "cpu")
    assert_one_line_error(proc, f"--model: no *.safetensors files in {folder}", prefix="torchtitan_rl: error: ")
