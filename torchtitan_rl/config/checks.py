"""Small checks the config sections use on their own fields, and walks over the config tree.

Each raises ``ValueError("section.field: message")``; no torch here (``--help`` stays instant).
"""

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any


class Problems:
    """The ValueErrors of independent checks, raised as one (``A | B``): a config with several mistakes is
    refused once, naming each, not once a mistake."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self._fields: list[str] = []

    def check(self, check: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """Run ``check``; keep its ValueError's message (the first problem it finds) unless the message names a
        field an earlier problem is about: it follows from that one (a NaN is also out of range; 0 prompts a step
        leave no rows for grpo.mini_batches)."""
        try:
            check(*args, **kwargs)
        except ValueError as e:
            message = str(e)
            if not any(re.search(rf"(?<![\w.]){re.escape(field)}(?![\w.\[])", message) for field in self._fields):
                self.found.append(message)
                self._fields.append(message.partition(":")[0])

    def raise_any(self) -> None:
        if self.found:
            raise ValueError(" | ".join(self.found))


def get(cfg: Any, path: str) -> Any:
    """The field at a dotted path, e.g. ``get(cfg, "trainer.optimizer.lr")``."""
    obj = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def replace(cfg: Any, path: str, value: Any) -> Any:
    """``cfg`` with the field at dotted ``path`` set to ``value`` (new dataclasses on the way; ``cfg`` unchanged)."""
    head, _, rest = path.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: replace(getattr(cfg, head), rest, value)})


def leaf_types(cls: type, prefix: str = "") -> dict[str, Any]:
    """Dotted field path -> type, for every non-dataclass field."""
    out = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type):
            out |= leaf_types(f.type, f"{prefix}{f.name}.")
        else:
            out[prefix + f.name] = f.type
    return out


def check_finite(cfg: Any, prefix: str = "") -> None:
    """Every float field (in a tuple too) of the tree is a finite number: NaN passes every `<` check."""
    for f in dataclasses.fields(cfg):
        value, path = getattr(cfg, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            check_finite(value, path + ".")
            continue
        items = enumerate(value) if isinstance(value, tuple) else [(None, value)]
        for i, item in items:
            if isinstance(item, float) and not math.isfinite(item):
                where = path if i is None else f"{path}[{i}]"
                raise ValueError(f"{where}: must be a finite number, got {item}")


def at_least(section: Any, path: str, low: int, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value < low:
            raise ValueError(f"{path}.{name}: must be >= {low}, got {value}")


def positive(section: Any, path: str, *names: str) -> None:
    at_least(section, path, 1, *names)


def positive_float(section: Any, path: str, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if not value > 0:
            raise ValueError(f"{path}.{name}: must be > 0, got {value}")


def in_range(section: Any, path: str, name: str, low: float, high: float, text: str) -> None:
    """``text`` is the interval as shown, e.g. "(0, 1]": its brackets say which ends are allowed."""
    value = getattr(section, name)
    ok_low = value >= low if text[0] == "[" else value > low
    ok_high = value <= high if text[-1] == "]" else value < high
    if not (ok_low and ok_high):
        raise ValueError(f"{path}.{name}: must be in {text}, got {value}")
