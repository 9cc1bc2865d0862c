"""Turn the ``grpo.task`` string (+ the ``task`` config section) into a Task, and check it fits the model.

Built-ins:

- ``digits`` / ``digits:<mode>`` (copy, reverse, repeat_first): its own 16-token
  tokenizer, for a randomly initialised tiny model only.
- ``math``: arithmetic word problems (tasks/arithmetic.py).
- ``calculator``: the same problems, multi-turn, with a calculator tool (tasks/calculator.py).
- ``dataset``: a JSONL or Parquet file (tasks/dataset.py).

``math`` and ``dataset`` use the tokenizer and chat template of ``task.tokenizer``,
else of ``model.hf_checkpoint``.

Anything else of the form ``package.module:factory`` imports the user's
factory and calls it with the keyword arguments its signature names (all of
them if it takes ``**kwargs``; none if it takes none):

- ``config``: the ``task`` section (a TaskConfig),
- ``tokenizer_dir``: the tokenizer folder above (None if neither is set).
"""

import importlib
import inspect
from pathlib import Path

from torchtitan_rl.config import TaskConfig
from torchtitan_rl.grpo.tasks.base import Task
from torchtitan_rl.grpo.tasks.digits import MODES, DigitsTask


CHAT_TASKS = ("math", "calculator", "dataset")
"""Built-in tasks on the checkpoint's tokenizer and chat template."""


def build_task(
    spec: str, config: TaskConfig | None = None, *, tokenizer_dir: str | None = None,
    max_prompt_tokens: int | None = None,
) -> Task:
    """Build the task named by ``spec`` (the value of ``grpo.task``); a dataset's prompts must fit
    ``max_prompt_tokens`` (what the generator's context leaves beside a completion)."""
    config = config or TaskConfig()
    name, _, arg = spec.partition(":")
    if name == "digits":
        # DigitsTask raises its own grpo.task ValueError for an unknown mode.
        return DigitsTask(mode=arg) if arg else DigitsTask()
    if name in CHAT_TASKS and arg:
        raise ValueError(f"grpo.task: {name!r} takes no ':<arg>' (got {spec!r}); its settings are in [task]")
    if name in CHAT_TASKS:
        if tokenizer_dir is None:
            raise ValueError(f"task.tokenizer: grpo.task '{name}' needs task.tokenizer or model.hf_checkpoint")
        field = "task.tokenizer" if config.tokenizer else "model.hf_checkpoint"
        if name == "math":
            from torchtitan_rl.grpo.tasks.arithmetic import MathTask

            return MathTask(config, tokenizer_dir=tokenizer_dir, field=field)
        if name == "calculator":
            from torchtitan_rl.grpo.tasks.calculator import CalculatorTask

            return CalculatorTask(config, tokenizer_dir=tokenizer_dir, field=field)
        from torchtitan_rl.grpo.tasks.dataset import DatasetTask

        return DatasetTask(config, tokenizer_dir=tokenizer_dir, field=field, max_prompt_tokens=max_prompt_tokens)
    if not arg:
        raise ValueError(
            f"grpo.task: unknown task {spec!r}; use 'digits', 'digits:<mode>' with mode in {MODES}, "
            "'math', 'calculator', 'dataset', or 'package.module:factory' for a user task"
        )
    return _build_user_task(spec, module_name=name, factory_name=arg,
                            kwargs={"config": config, "tokenizer_dir": tokenizer_dir})


def _build_user_task(spec: str, *, module_name: str, factory_name: str, kwargs: dict) -> Task:
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"grpo.task: cannot import module {module_name!r} of {spec!r}: {e}") from e
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ValueError(
            f"grpo.task: {module_name!r} has no callable {factory_name!r} (from {spec!r})"
        )
    params = inspect.signature(factory).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    task = factory(**kwargs)
    if not isinstance(task, Task):
        raise ValueError(
            f"grpo.task: factory {spec!r} returned {type(task).__name__}, "
            "expected a torchtitan_rl.grpo.tasks.Task subclass instance"
        )
    return task


def check_vocabulary(task: Task, *, spec: str, model_vocab_size: int, hf_checkpoint: str | None) -> None:
    """ValueError unless the task's token ids mean to the model what they mean to the task.

    Every id must fit the model's embedding table, and with a pretrained
    checkpoint the task must speak that checkpoint's tokenizer: the digits
    task's 16 ids would fit any model but name other tokens in a real one.
    """
    where = f"model.hf_checkpoint {hf_checkpoint}" if hf_checkpoint else "the model"
    if task.vocab_size > model_vocab_size:
        raise ValueError(
            f"grpo.task {spec!r}: its tokenizer has {task.vocab_size} token ids, more than {where}'s "
            f"vocab_size {model_vocab_size}"
        )
    if hf_checkpoint is None or not (Path(hf_checkpoint) / "tokenizer.json").is_file():
        return
    from tokenizers import Tokenizer

    theirs = Tokenizer.from_file(str(Path(hf_checkpoint) / "tokenizer.json")).get_vocab()
    if task.tokenizer.get_vocab() != theirs:
        raise ValueError(
            f"grpo.task {spec!r}: its tokenizer ({task.vocab_size} token ids) is not the tokenizer of {where} "
            f"(vocab_size {model_vocab_size}, tokenizer {max(theirs.values()) + 1} ids): its token ids would "
            "mean other tokens to this model; use grpo.task 'math' or 'dataset' (they read the checkpoint's "
            "tokenizer), or no model.hf_checkpoint"
        )
