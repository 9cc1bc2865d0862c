import json
import pickle
import random
from pathlib import Path

import pytest

from tests.helpers import SAMPLE_DATASET
from torchtitan_rl.config import TaskConfig
from torchtitan_rl.grpo.tasks.dataset import DatasetTask, answer_text, read_records



def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _problems(n: int) -> list[dict]:
    return [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(n)]


def _task(smollm2_dir, **config) -> DatasetTask:
    return DatasetTask(TaskConfig(**config), tokenizer_dir=str(smollm2_dir))


@pytest.mark.parametrize(
    "raw, expected",
    [("3 * 4 = 12\n#### 12", "12"), ("#### 1,080", "1080"), ("a #### b #### 7 ", "7"), ("42", "42"),
     (42, "42"), ("\\frac{1}{2}", "\\frac{1}{2}"), ("1,2", "1,2")],
)  # fmt: skip
def test_answer_field_follows_gsm8k_convention(raw, expected):
    assert answer_text(raw) == expected


def test_shipped_sample_reads_with_worked_solutions_stripped():
    records = read_records(str(SAMPLE_DATASET), field="task.path", prompt_field="question", answer_field="answer")
    assert len(records) >= 50
    assert records[0] == (
        "A bakery bakes 12 trays of muffins with 8 muffins on each tray. It sells 70 muffins in the morning. "
        "How many muffins are left?",
        "26",
    )
    assert all(a.lstrip("-").isdigit() for _, a in records), [a for _, a in records]
    assert len({q for q, _ in records}) == len(records)


def test_custom_field_names_and_parquet(tmp_path, smollm2_dir):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"problem": f"What is {i} times 3?", "solution": str(3 * i), "extra": i} for i in range(20)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    task = _task(smollm2_dir, path=str(tmp_path / "train.parquet"), prompt_field="problem", answer_field="solution",
                 heldout_fraction=0.25)
    assert len(task.heldout_prompts()) == 5
    assert {p.target for p in task.heldout_prompts() + task._train} == {str(3 * i) for i in range(20)}

    with pytest.raises(ValueError, match=r"task.prompt_field: .*train.parquet has no column 'question' "
                                         r"\(columns: problem, solution, extra\)"):
        _task(smollm2_dir, path=str(tmp_path / "train.parquet"))


def test_heldout_fraction_is_disjoint_fixed_and_order_independent(tmp_path, smollm2_dir):
    rows = _problems(40)
    a = _task(smollm2_dir, path=str(_write_jsonl(tmp_path / "a.jsonl", rows)), heldout_fraction=0.1)
    b = _task(smollm2_dir, path=str(_write_jsonl(tmp_path / "b.jsonl", rows[::-1])), heldout_fraction=0.1)
    held = {p.text for p in a.heldout_prompts()}
    assert len(held) == 4 and held == {p.text for p in b.heldout_prompts()}
    assert not held & {p.text for p in a._train} and len(a._train) == 36


def test_heldout_file_removes_its_questions_from_training(tmp_path, smollm2_dir):
    rows = _problems(10)
    train = _write_jsonl(tmp_path / "train.jsonl", rows)
    held = _write_jsonl(tmp_path / "held.jsonl", rows[:3])
    task = _task(smollm2_dir, path=str(train), heldout_path=str(held))
    assert len(task.heldout_prompts()) == 3 and len(task._train) == 7
    assert not {p.text for p in task.heldout_prompts()} & {p.text for p in task._train}


def test_every_epoch_is_a_new_permutation_of_the_training_set(tmp_path, smollm2_dir):
    task = _task(smollm2_dir, path=str(_write_jsonl(tmp_path / "d.jsonl", _problems(12))), heldout_fraction=0)
    rng = random.Random(0)
    drawn = [p.text for _ in range(6) for p in task.sample_prompts(5, generator=rng)]  # 30 = 2.5 epochs
    first, second = drawn[:12], drawn[12:24]
    assert sorted(first) == sorted(second) == sorted(p.text for p in task._train)
    assert first != second
    assert task.state_dict()["epoch"] == 3 and task.state_dict()["position"] == 6


def test_resumed_task_draws_exactly_the_uninterrupted_prompts(tmp_path, smollm2_dir):
    path = str(_write_jsonl(tmp_path / "d.jsonl", _problems(23)))
    steps, per_step = 12, 4

    uninterrupted = _task(smollm2_dir, path=path)
    rng = random.Random(5)
    expected = [[p.text for p in uninterrupted.sample_prompts(per_step, generator=rng)] for _ in range(steps)]

    for stop in (1, 5, 7):  # mid-epoch and at epoch boundaries
        first = _task(smollm2_dir, path=path)
        rng = random.Random(5)
        seen = [[p.text for p in first.sample_prompts(per_step, generator=rng)] for _ in range(stop)]
        # What the loop writes into a checkpoint's extras (pickled there).
        saved = pickle.loads(pickle.dumps({"prompt_rng": rng.getstate(), "task": first.state_dict()}))
        resumed = _task(smollm2_dir, path=path)
        rng = random.Random(0)
        rng.setstate(saved["prompt_rng"])
        resumed.load_state_dict(saved["task"])
        seen += [[p.text for p in resumed.sample_prompts(per_step, generator=rng)] for _ in range(steps - stop)]
        assert seen == expected, stop


def test_resume_against_a_changed_file_is_refused(tmp_path, smollm2_dir):
    task = _task(smollm2_dir, path=str(_write_jsonl(tmp_path / "d.jsonl", _problems(23))))
    task.sample_prompts(3, generator=random.Random(0))
    other = _task(smollm2_dir, path=str(_write_jsonl(tmp_path / "e.jsonl", _problems(30))))
    with pytest.raises(ValueError, match=r"task.path: .*e.jsonl now gives 27 training records, .* had 20"):
        other.load_state_dict(task.state_dict())


def test_missing_file_is_a_value_error_naming_the_field(tmp_path, smollm2_dir):
    with pytest.raises(ValueError, match=r"task.path: file not found: .*nope.jsonl"):
        _task(smollm2_dir, path=str(tmp_path / "nope.jsonl"))


def test_malformed_line_names_file_and_line(tmp_path, smollm2_dir):
    path = _write_jsonl(tmp_path / "d.jsonl", [*_problems(2), "", '{"question": "x", "answer": ', *_problems(1)])
    with pytest.raises(ValueError, match=r"task.path: .*d.jsonl:4: invalid JSON"):
        _task(smollm2_dir, path=str(path))
    path = _write_jsonl(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(ValueError, match=r"task.path: .*list.jsonl:1: expected a JSON object, got list"):
        _task(smollm2_dir, path=str(path))


def test_missing_field_names_field_file_and_line(tmp_path, smollm2_dir):
    path = _write_jsonl(tmp_path / "d.jsonl", [*_problems(2), {"question": "What is 1 + 1?", "solution": "2"}])
    with pytest.raises(ValueError, match=r"task.answer_field: .*d.jsonl:3 has no field 'answer' "
                                         r"\(fields: question, solution\)"):
        _task(smollm2_dir, path=str(path))


def test_unknown_extension_and_empty_file_are_refused(tmp_path, smollm2_dir):
    (tmp_path / "d.csv").write_text("question,answer\n")
    with pytest.raises(ValueError, match=r"task.path: .*d.csv: expected a .jsonl or .parquet file"):
        _task(smollm2_dir, path=str(tmp_path / "d.csv"))
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"task.path: .*e.jsonl holds no records"):
        _task(smollm2_dir, path=str(tmp_path / "e.jsonl"))


def test_a_prompt_longer_than_the_context_leaves_is_refused_at_startup(tmp_path, smollm2_dir):
    path = tmp_path / "long.jsonl"
    path.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n'
                    + json.dumps({"question": "Add these: " + " + ".join(["1"] * 200), "answer": "200"}) + "\n")
    with pytest.raises(ValueError, match=r"^task.path: a question in .*long.jsonl takes \d+ tokens .* more than the 120"):
        DatasetTask(TaskConfig(path=str(path), heldout_fraction=0.0), tokenizer_dir=str(smollm2_dir),
                    max_prompt_tokens=120)
