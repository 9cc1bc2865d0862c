"""grpo.task = "dataset": questions and answers from a local JSONL or Parquet file.

Each record (a JSON object per line, or a Parquet row) gives a question in
``task.prompt_field`` and an answer in ``task.answer_field``; GSM8K's
convention (worked solution, then ``#### 42``) is read as the part after the
last ``####``, thousands separators dropped. Held out: a second file
(``task.heldout_path``) or a fixed share of the first, picked by a hash of
the question (so it does not depend on the file's order) and removed from
training by question text.

Training order: the training records are shuffled once per epoch, with a seed
drawn from the run's prompt RNG when the epoch starts. The task's state is
(epoch, that seed, position in the epoch); checkpoints save it next to the
prompt RNG, so a resumed run draws exactly the prompts an uninterrupted one
would.
"""

import json
import math
import random
import re
from pathlib import Path

from torchtitan_rl.config import TaskConfig
from torchtitan_rl.grpo.tasks.base import Prompt
from torchtitan_rl.grpo.tasks.chat import ChatTask, stable_hash

_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")


def answer_text(raw) -> str:
    """The reference answer in a field: after GSM8K's last '####', '1,234' read as '1234'."""
    text = str(raw)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    text = text.strip()
    return text.replace(",", "") if _THOUSANDS.match(text) else text


def read_records(path: str, *, field: str, prompt_field: str, answer_field: str, fields: str = "task",
                 split: str = "") -> list[tuple[str, str]]:
    """(question, answer) pairs of a .jsonl/.json or .parquet file, or of a folder datasets' save_to_disk
    wrote (``split``: the one to read of several); ValueError naming the config field (``field``, or
    ``fields``.prompt_field / .answer_field), the file and the line."""
    file = Path(path)
    columns = (prompt_field, answer_field)
    if file.is_dir():
        rows = _saved_dataset_rows(file, field=field, split=split, columns=columns, fields=fields)
    elif not file.is_file():
        raise ValueError(f"{field}: file not found: {path}")
    elif file.suffix == ".parquet":
        rows = _parquet_rows(file, field=field, columns=columns, fields=fields)
    elif file.suffix in (".jsonl", ".json"):
        rows = _jsonl_rows(file, field=field)
    else:
        raise ValueError(f"{field}: {path}: expected a .jsonl or .parquet file, or a datasets folder")
    records = []
    for where, row in rows:
        for key, name in ((prompt_field, f"{fields}.prompt_field"), (answer_field, f"{fields}.answer_field")):
            if row.get(key) is None:
                raise ValueError(f"{name}: {where} has no field {key!r} (fields: {', '.join(sorted(row))})")
        answer = answer_text(row[answer_field])
        if not answer:
            raise ValueError(f"{fields}.answer_field: {where}: empty answer in {answer_field!r}")
        records.append((str(row[prompt_field]), answer))
    if not records:
        raise ValueError(f"{field}: {path} holds no records")
    return records


def _jsonl_rows(file: Path, *, field: str):
    try:
        with file.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{field}: {file}:{number}: invalid JSON: {e.msg}") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{field}: {file}:{number}: expected a JSON object, got {type(row).__name__}")
                yield f"{file}:{number}", row
    except UnicodeDecodeError as e:
        raise ValueError(f"{field}: {file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except PermissionError:
        raise ValueError(f"{field}: {file}: not readable (permission denied)") from None


def _parquet_rows(file: Path, *, field: str, columns: tuple[str, ...], fields: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{field}: reading {file} needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(file)
    except Exception as e:  # pyarrow raises its own error types for a damaged file
        raise ValueError(f"{field}: {file}: not a readable Parquet file: {e}") from None
    yield from _table_rows(table, file=str(file), columns=columns, fields=fields)


def _table_rows(table, *, file: str, columns: tuple[str, ...], fields: str):
    """Rows of a pyarrow table, after checking it has both columns."""
    for name, key in zip((f"{fields}.prompt_field", f"{fields}.answer_field"), columns):
        if key not in table.column_names:
            raise ValueError(f"{name}: {file} has no column {key!r} (columns: {', '.join(table.column_names)})")
    for number, row in enumerate(table.select(list(columns)).to_pylist(), 1):
        yield f"{file} row {number}", row


def _saved_dataset_rows(folder: Path, *, field: str, split: str, columns: tuple[str, ...], fields: str):
    """Rows of a folder written by datasets' ``save_to_disk`` (a Dataset, or a DatasetDict's ``split``)."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{field}: reading the folder {folder} needs datasets (pip install datasets)") from None
    try:
        data = datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError, OSError) as e:
        raise ValueError(f"{field}: {folder}: not a folder datasets' save_to_disk wrote ({e})") from None
    if isinstance(data, datasets.DatasetDict):
        name = split or (next(iter(data)) if len(data) == 1 else None)
        if name not in data:
            raise ValueError(f"{fields}.split: {folder} holds splits {sorted(data)}; name one"
                             + (f" (got {split!r})" if split else ""))
        data = data[name]
    yield from _table_rows(data.data.table, file=str(folder), columns=columns, fields=fields)


def split_heldout(records: list[tuple[str, str]], fraction: float) -> tuple[list, list]:
    """(train, held-out): the ceil(fraction * n) records of smallest question hash, held out."""
    if fraction == 0:
        return records, []
    ranked = sorted(range(len(records)), key=lambda i: (stable_hash(records[i][0]), i))
    held = set(ranked[: math.ceil(fraction * len(records))])
    return [r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held]


class DatasetTask(ChatTask):
    """A file of (question, answer) records in the model's chat template, reshuffled every epoch."""

    def __init__(self, config: TaskConfig, *, tokenizer_dir: str, field: str = "task.tokenizer",
                 max_prompt_tokens: int | None = None, **kwargs) -> None:
        super().__init__(config, tokenizer_dir=tokenizer_dir, field=field, **kwargs)
        read = dict(prompt_field=config.prompt_field, answer_field=config.answer_field)
        records = read_records(config.path, field="task.path", **read)
        if config.heldout_path is not None:
            heldout = read_records(config.heldout_path, field="task.heldout_path", **read)
        else:
            records, heldout = split_heldout(records, config.heldout_fraction)
        heldout_questions = {q for q, _ in heldout}
        train = [r for r in records if r[0] not in heldout_questions]  # duplicates of held-out questions too
        if not train:
            raise ValueError(f"task.path: no training records left in {config.path} after holding out")
        self.path = config.path
        self._train = [self.make_prompt(q, a) for q, a in train]
        self._heldout = [self.make_prompt(q, a) for q, a in heldout]
        if max_prompt_tokens is not None:  # refused now, not by vLLM mid-run
            for name, prompts in (("task.path", self._train), ("task.heldout_path", self._heldout)):
                longest = max(prompts, key=lambda p: len(p.token_ids), default=None)
                if longest is not None and len(longest.token_ids) > max_prompt_tokens:
                    file = config.heldout_path if name == "task.heldout_path" and config.heldout_path else config.path
                    raise ValueError(
                        f"{name}: a question in {file} takes {len(longest.token_ids)} tokens in the chat template, "
                        f"more than the {max_prompt_tokens} that generator.max_model_len leaves beside the "
                        f"completion's max_tokens: {longest.text[:80]!r}..."
                    )
        self._epoch, self._epoch_seed, self._position = 0, None, 0
        self._order: list[int] = []

    def sample_prompts(self, n: int, *, generator: random.Random) -> list[Prompt]:
        out = []
        while len(out) < n:
            if self._position == len(self._order):  # also at the very start: no epoch yet
                self._start_epoch(self._epoch + 1, generator.getrandbits(64))
            out.append(self._train[self._order[self._position]])
            self._position += 1
        return out

    def sample_extra_prompts(self, n: int, *, generator: random.Random) -> list[Prompt]:
        """Any ``n`` training records by ``generator``, without moving the epoch's position."""
        return [self._train[generator.randrange(len(self._train))] for _ in range(n)]

    def _start_epoch(self, epoch: int, seed: int) -> None:
        self._epoch, self._epoch_seed, self._position = epoch, seed, 0
        self._order = list(range(len(self._train)))
        random.Random(seed).shuffle(self._order)

    def heldout_prompts(self) -> list[Prompt]:
        return list(self._heldout)

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "epoch_seed": self._epoch_seed, "position": self._position,
                "num_train": len(self._train)}

    def load_state_dict(self, state: dict) -> None:
        if not state:  # a checkpoint from before any prompt was drawn
            return
        if state.get("num_train") != len(self._train):
            raise ValueError(
                f"task.path: {self.path} now gives {len(self._train)} training records, the checkpoint's "
                f"run had {state.get('num_train')}; resuming would not continue its order"
            )
        if state["epoch_seed"] is not None:
            self._start_epoch(state["epoch"], state["epoch_seed"])
            self._position = state["position"]
