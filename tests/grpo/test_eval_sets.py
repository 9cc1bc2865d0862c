"""Named evaluation sets: config, files of every kind, and one-line errors for bad ones."""

import json
from pathlib import Path

import pytest

from tests.helpers import assert_one_line_error, run_cli
from torchtitan_rl.config import EvalSetConfig, JobConfig, from_dict, to_toml, validate
from torchtitan_rl.grpo.eval_sets import EvalSet
from torchtitan_rl.grpo.evaluate import standard_error
from torchtitan_rl.grpo.tasks.chat import load_chat_tokenizer

import tomllib

REPO = Path(__file__).resolve().parents[2]
WORD_PROBLEMS = REPO / "torchtitan_rl" / "grpo" / "tasks" / "data" / "word_problems_eval.jsonl"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_chat_tokenizer(str(smollm2_dir), field="task.tokenizer")


def _set(tokenizer, path, **fields) -> EvalSet:
    return EvalSet(EvalSetConfig(name="s", path=str(path), **fields), field="eval.sets[0]", tokenizer=tokenizer,
                   system_prompt="You are a helpful assistant.", instruction="Put the final answer in \\boxed{}.")


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sets_are_toml_array_tables_that_round_trip():
    cfg = from_dict(tomllib.loads(f"""
[eval]
every_n_steps = 5
[[eval.sets]]
name = "words"
path = "{WORD_PROBLEMS}"
instruction = "Answer with a number."
[[eval.sets]]
name = "other"
path = "{WORD_PROBLEMS}"
mean_at_k = 4
numeric_answer = "expression"
"""))
    assert [s.name for s in cfg.eval.sets] == ["words", "other"]
    assert cfg.eval.sets[0].instruction == "Answer with a number." and cfg.eval.sets[1].instruction is None
    assert [s.numeric_answer for s in cfg.eval.sets] == ["number", "expression"]
    assert from_dict(tomllib.loads(to_toml(cfg))) == cfg
    with pytest.raises(ValueError, match=r"^eval.sets\[0\].numeric_answer: expected one of 'number', 'expression'"):
        from_dict({"eval": {"sets": [{"name": "w", "path": str(WORD_PROBLEMS), "numeric_answer": "literal"}]}})


@pytest.mark.parametrize("change, expected", [
    (dict(name="a b"), "eval.sets[0].name: must be non-empty letters"),
    (dict(name="heldout"), "eval.sets[0].name: must be non-empty letters"),
    (dict(path="/nonexistent.jsonl"), "eval.sets[0].path: not found: /nonexistent.jsonl"),
    (dict(mean_at_k=-1), "eval.sets[0].mean_at_k: must be >= 0"),
    (dict(max_tokens=64), "eval.sets[0].max_tokens: 64 leaves no room for a prompt"),
])
def test_impossible_set_settings_name_their_field(change, expected, smollm2_dir):
    cfg = JobConfig()
    cfg.grpo.task, cfg.task.tokenizer, cfg.eval.every_n_steps = "math", str(smollm2_dir), 1
    cfg.eval.sets = (EvalSetConfig(**{"name": "words", "path": str(WORD_PROBLEMS), **change}),)
    with pytest.raises(ValueError) as err:
        validate(cfg)
    assert str(err.value).startswith(expected), str(err.value)


def test_sets_need_an_evaluation_interval_distinct_names_and_a_chat_tokenizer(smollm2_dir):
    cfg = JobConfig()  # digits: no tokenizer with a chat template
    cfg.eval.sets = (EvalSetConfig(name="words", path=str(WORD_PROBLEMS)),)
    with pytest.raises(ValueError, match=r"^eval.every_n_steps: eval.sets are scored every N steps"):
        validate(cfg)
    cfg.eval.every_n_steps = 2
    with pytest.raises(ValueError, match=r"^eval.sets: a named set is asked in the chat template"):
        validate(cfg)
    cfg.task.tokenizer = str(smollm2_dir)
    validate(cfg)  # digits has no held-out set of its own; the named set is enough
    cfg.eval.sets = cfg.eval.sets * 2
    with pytest.raises(ValueError, match=r"^eval.sets: names must differ"):
        validate(cfg)


def test_a_set_added_to_cpu_tiny_is_refused_once_naming_every_problem(tmp_path):
    """cpu_tiny + [[eval.sets]]: no eval.every_n_steps, no chat template, a set file that is not there. One
    refusal names all three (before: the first only, then the next after each fix)."""
    config = tmp_path / "config.toml"
    config.write_text((REPO / "run_configs" / "cpu_tiny.toml").read_text()
                      + f'\n[[eval.sets]]\nname = "mine"\npath = "{tmp_path / "missing.jsonl"}"\n')
    proc = run_cli("--config", str(config), "--job.output_dir", str(tmp_path / "out"), "--dry-run")
    line = assert_one_line_error(proc)
    assert line == ("config error: eval.every_n_steps: eval.sets are scored every N steps; set N > 0 | eval.sets: a "
                    "named set is asked in the chat template of task.tokenizer or model.hf_checkpoint; set one | "
                    f"eval.sets[0].path: not found: {tmp_path / 'missing.jsonl'}"), line


def test_a_set_renders_in_the_chat_template_with_its_own_instruction_and_verifies(tokenizer):
    words = _set(tokenizer, WORD_PROBLEMS, num_prompts=5)
    assert len(words.prompts) == 5 and words.prompts[0].target == "112"
    assert words.prompts[0].text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
    assert words.prompts[0].text.endswith("Put the final answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    own = _set(tokenizer, WORD_PROBLEMS, num_prompts=1, system_prompt="", instruction="Answer with a number.")
    # An empty system prompt leaves it to the chat template's default (SmolLM2's own).
    assert "You are a helpful assistant." not in own.prompts[0].text
    assert own.prompts[0].text.endswith("Answer with a number.<|im_end|>\n<|im_start|>assistant\n")

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    p = words.prompts[0]
    assert words.correct(p, ids("4 * 35 = 140, 140 - 28 = 112. \\boxed{112}"))
    assert not words.correct(p, ids("\\boxed{140}"))
    exact = _set(tokenizer, WORD_PROBLEMS, num_prompts=1, verifier="exact")
    assert exact.correct(p, ids(" 112 ")) and not exact.correct(p, ids("\\boxed{112}"))


def test_a_sets_numeric_answer_decides_whether_an_unevaluated_expression_counts(tokenizer):
    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    unevaluated = ids("4 boxes of 35 is 4 * 35, minus 28: 4 * 35 - 28 = 4 * 35 - 28")  # 112, never computed
    number = _set(tokenizer, WORD_PROBLEMS, num_prompts=1)  # the default, as training's
    expression = _set(tokenizer, WORD_PROBLEMS, num_prompts=1, numeric_answer="expression")
    p = number.prompts[0]
    assert p.target == "112" and not number.correct(p, unevaluated) and number.reward(p, unevaluated) == 0.0
    assert expression.correct(p, unevaluated) and expression.reward(p, unevaluated) == 1.0
    assert number.correct(p, ids("4 * 35 - 28 = 112")) and expression.correct(p, ids("4 * 35 - 28 = 112"))


def test_parquet_and_datasets_folders_read_as_jsonl(tokenizer, tmp_path):
    import datasets

    rows = [json.loads(line) for line in WORD_PROBLEMS.read_text().splitlines()[:6]]
    table = datasets.Dataset.from_list([{"problem": r["question"], "solution": r["answer"]} for r in rows])
    table.to_parquet(str(tmp_path / "p.parquet"))
    datasets.DatasetDict({"train": table, "test": table.select(range(3))}).save_to_disk(str(tmp_path / "dd"))
    mapped = dict(prompt_field="problem", answer_field="solution")
    want = [p.text for p in _set(tokenizer, WORD_PROBLEMS, num_prompts=6).prompts]
    assert [p.text for p in _set(tokenizer, tmp_path / "p.parquet", **mapped).prompts] == want
    assert [p.text for p in _set(tokenizer, tmp_path / "dd", split="test", **mapped).prompts] == want[:3]
    with pytest.raises(ValueError, match=r"^eval.sets\[0\].split: .* holds splits \['test', 'train'\]; name one"):
        _set(tokenizer, tmp_path / "dd", **mapped)


@pytest.mark.parametrize("case", ["missing field", "empty", "not utf-8", "bad json", "damaged parquet",
                                  "not an object"])
def test_a_bad_set_file_is_one_error_naming_the_file_and_field(case, tokenizer, tmp_path):
    path = tmp_path / ("d.parquet" if "parquet" in case else "d.jsonl")
    if case == "missing field":
        _write(path, [{"question": "What is 1 + 1?", "answer": "2"}, {"question": "What is 2 + 2?", "solution": 4}])
        expected = f"eval.sets[0].answer_field: {path}:2 has no field 'answer' (fields: question, solution)"
    elif case == "empty":
        path.write_text("\n")
        expected = f"eval.sets[0].path: {path} holds no records"
    elif case == "not utf-8":
        path.write_bytes(b'{"question": "\xff\xfe"}\n')
        expected = f"eval.sets[0].path: {path}: not UTF-8 text"
    elif case == "bad json":
        path.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n{"question": \n')
        expected = f"eval.sets[0].path: {path}:2: invalid JSON"
    elif case == "damaged parquet":
        path.write_bytes(b"PAR1 not really")
        expected = f"eval.sets[0].path: {path}: not a readable Parquet file"
    else:
        path.write_text('["What is 1 + 1?", "2"]\n')
        expected = f"eval.sets[0].path: {path}:1: expected a JSON object, got list"
    with pytest.raises(ValueError) as err:
        _set(tokenizer, path)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value), str(err.value)


@pytest.mark.slow  # a whole run or engine in its own process: 7-12 s, out of the quick loop
def test_a_bad_set_stops_the_run_in_one_line_before_its_folder_exists(tmp_path, smollm2_dir):
    data = _write(tmp_path / "d.jsonl", [{"question": "What is 1 + 1?", "solution": "2"}])
    out = tmp_path / "out"
    config = tmp_path / "c.toml"
    config.write_text(f"""
[grpo]
task = "math"
[task]
tokenizer = "{smollm2_dir}"
[eval]
every_n_steps = 1
[[eval.sets]]
name = "bad"
path = "{data}"
""")
    proc = run_cli("--config", str(config), "--job.output_dir", str(out), "--model.max_seq_len", "256",
                   "--generator.max_model_len", "256")
    assert_one_line_error(proc, f"eval.sets[0].answer_field: {data}:1 has no field 'answer'",
                          prefix="torchtitan_rl: error: ")
    assert not out.exists() or not any(out.iterdir())


def test_standard_error_is_the_spread_of_problem_scores_over_root_n():
    assert standard_error([1.0, 0.0, 1.0, 0.0]) == pytest.approx(0.25)  # sqrt(0.25 / 4)
    assert standard_error([1.0] * 9) == 0.0
    assert standard_error([0.5, 1.0]) == pytest.approx(0.25 / 2**0.5)
