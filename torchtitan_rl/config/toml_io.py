"""JobConfig from a TOML file (strict: unknown keys and wrong types name the field) and back.

``None`` in TOML: TOML has no null, so :func:`to_toml` omits a ``None`` field
and loading falls back to the default. That round-trips because every
``X | None`` field defaults to ``None`` (asserted in :func:`to_toml`).
"""

import dataclasses
import difflib
import json
import os
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from torchtitan_rl.config.job_config import REDACTED, SECRETS, JobConfig


def load_toml(path: str | os.PathLike) -> JobConfig:
    """Read a TOML file into a JobConfig; unknown keys and wrong types raise ValueError naming the file and field."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"--config: file not found: {path}") from None
    except OSError as e:
        raise ValueError(f"--config: cannot read {path}: {e.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        line = re.search(r"line (\d+)", str(e))
        where = f"{path}:{line.group(1)}" if line else str(path)
        raise ValueError(f"{where}: invalid TOML: {e}") from None
    try:
        return from_dict(data)
    except ValueError as e:  # a run's or a checkpoint's config.toml as well as --config: say which file
        raise ValueError(f"{path}: {e}") from None


def from_dict(data: dict[str, Any]) -> JobConfig:
    """Build a JobConfig from nested dicts as tomllib returns them (strict)."""
    return _build(JobConfig(), data, "")


def _build(default: Any, data: dict[str, Any], prefix: str) -> Any:
    """default with data's keys replaced; nested tables start from default's sections
    (a generator's parallelism default differs from ParallelismConfig's)."""
    fields = {f.name: f for f in dataclasses.fields(default)}
    for key in data:
        if key not in fields:
            raise ValueError(_unknown_key(prefix + key, [prefix + n for n in fields]))
    kwargs = {}
    for name, value in data.items():
        tp, path = fields[name].type, prefix + name
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ValueError(f"{path}: expected a table, got {_describe(value)}")
            kwargs[name] = _build(getattr(default, name), value, path + ".")
        else:
            kwargs[name] = _coerce(value, tp, path)
    return dataclasses.replace(default, **kwargs)


def _unknown_key(path: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(path, valid, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else "valid: " + ", ".join(valid)
    return f"unknown key '{path}' ({hint})"


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        assert len(inner) == 1, f"{path}: only 'X | None' unions are supported"
        return _coerce(value, inner[0], path)
    if origin is Literal:
        if value not in args or type(value) is not type(args[0]):
            choices = ", ".join(repr(a) for a in args)
            raise ValueError(f"{path}: expected one of {choices}, got {_describe(value)}")
        return value
    if dataclasses.is_dataclass(tp):  # an item of an array of tables ([[eval.sets]])
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected a table, got {_describe(value)}")
        return _build(tp(), value, path + ".")
    if origin is tuple:
        n = "" if args[-1] is Ellipsis else f"{len(args)} "
        want = f"an array of {n}{_type_name(args[0])}"
        if not isinstance(value, list) or (n and len(value) != len(args)):
            raise ValueError(f"{path}: expected {want}, got {_describe(value)}")
        item_types = list(args) if n else [args[0]] * len(value)
        items = enumerate(zip(value, item_types))
        return tuple(_coerce(v, t, f"{path}[{i}]") for i, (v, t) in items)
    if tp is float and type(value) is int:
        return float(value)
    if type(value) is not tp:  # bool is not an int here, and int is not a str
        raise ValueError(f"{path}: expected {_type_name(tp)}, got {_describe(value)}")
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    kind = {dict: "table", list: "array"}.get(type(value), type(value).__name__)
    return f"{kind} {value!r}"


def to_toml(cfg: JobConfig) -> str:
    """TOML text that load_toml reads back to an equal config (None fields are omitted)."""
    lines: list[str] = []
    _emit(cfg, "", lines)
    return "\n".join(lines).strip() + "\n"


def write_toml(cfg: JobConfig, path: str | os.PathLike) -> None:
    """Write to_toml(cfg) to path, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(cfg))


def _emit(obj: Any, table: str, lines: list[str]) -> None:
    sub_tables, arrays = [], []
    if table:
        lines += ["", f"[{table}]"]
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            sub_tables.append((f.name, value))
        elif isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
            arrays.append((f.name, value))
        elif value is None:
            assert f.default is None, f"{table}.{f.name}: None must be the default to round-trip"
        else:
            secret = f"{table}.{f.name}" in SECRETS and value
            lines.append(f"{f.name} = {_toml_value(REDACTED if secret else value)}")
    for name, items in arrays:  # [[table.name]] after the table's own keys, before its sub-tables
        for item in items:
            lines += ["", f"[[{table}.{name}]]"]
            _emit_keys(item, f"{table}.{name}", lines)
    for name, value in sub_tables:
        _emit(value, f"{table}.{name}" if table else name, lines)


def _emit_keys(obj: Any, table: str, lines: list[str]) -> None:
    """An array item's keys (no nested tables in one)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        assert not dataclasses.is_dataclass(value), f"{table}.{f.name}: nested table in an array item"
        if value is None:
            assert f.default is None, f"{table}.{f.name}: None must be the default to round-trip"
        else:
            lines.append(f"{f.name} = {_toml_value(value)}")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # repr of a float is valid TOML: 1e-06, inf, nan
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON escapes are TOML escapes
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise AssertionError(f"cannot write {value!r} to TOML")
