"""Turn the ``grpo.task`` string into a Task.

Built-ins: ``digits`` and ``digits:<mode>`` (copy, reverse, repeat_first).
Anything else of the form ``package.module:factory`` imports the user's
zero-argument factory and calls it; that is how user tasks plug in without
touching this package.
"""

import importlib

from torchtitan_rl.grpo.tasks.base import Task
from torchtitan_rl.grpo.tasks.digits import MODES, DigitsTask


def build_task(spec: str) -> Task:
    """Build the task named by ``spec`` (the value of ``grpo.task``)."""
    name, _, arg = spec.partition(":")
    if name == "digits":
        # DigitsTask raises its own grpo.task ValueError for an unknown mode.
        return DigitsTask(mode=arg) if arg else DigitsTask()
    if not arg:
        raise ValueError(
            f"grpo.task: unknown task {spec!r}; use 'digits', 'digits:<mode>' "
            f"with mode in {MODES}, or 'package.module:factory' for a user task"
        )
    return _build_user_task(spec, module_name=name, factory_name=arg)


def _build_user_task(spec: str, *, module_name: str, factory_name: str) -> Task:
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"grpo.task: cannot import module {module_name!r} of {spec!r}: {e}") from e
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ValueError(
            f"grpo.task: {module_name!r} has no callable {factory_name!r} (from {spec!r})"
        )
    task = factory()
    if not isinstance(task, Task):
        raise ValueError(
            f"grpo.task: factory {spec!r} returned {type(task).__name__}, "
            "expected a torchtitan_rl.grpo.tasks.Task subclass instance"
        )
    return task
