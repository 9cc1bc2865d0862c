"""The command line: ``--config FILE.toml``, then ``--section.field`` overrides (tyro), then validate.

Precedence: command line > file > the defaults in job_config.py. Every user
mistake becomes one line "config error: ..." on stderr and exit code 2.
"""

import contextlib
import difflib
import io
import os
import sys
import types
import typing
from typing import Literal

from torchtitan_rl.config.checks import leaf_types
from torchtitan_rl.config.job_config import JobConfig
from torchtitan_rl.config.toml_io import load_toml
from torchtitan_rl.config.validation import validate

_DESCRIPTION = (
    "GRPO post-training: torchtitan trainer + vLLM generator. "
    "--config FILE.toml loads a run config (see run_configs/); any flag below "
    "overrides it, e.g. --trainer.optimizer.lr 1e-4 (bools: --flag, --no-flag or "
    "--flag false). Precedence: command line > file > defaults; "
    "the defaults shown include the file's values. Named evaluation sets are [[eval.sets]] tables "
    "in the file (run_configs/smollm2_135m_math.toml has one); --eval.sets.N.FIELD then overrides them."
)


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """The CLI boundary: --config FILE.toml, then --section.field overrides, then validate.

    World size for validation comes from $WORLD_SIZE (torchrun), default 1.
    On bad input prints one line "config error: ..." to stderr and exits 2.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        config_path, rest = _split_config_arg(argv)
        default = load_toml(config_path) if config_path else JobConfig()
        rest = _normalize_bool_args(rest)
        cfg = _tyro_cli(default, rest)
        validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as e:
        if os.environ.get("RANK", "0") == "0":  # every torchrun rank parses the same argv: one line, not one a rank
            print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return cfg


def _split_config_arg(argv: list[str]) -> tuple[str | None, list[str]]:
    path, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or arg.startswith("--config="):
            if path is not None:
                raise ValueError("--config: given more than once")
            if "=" in arg:
                path = arg.split("=", 1)[1]
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                path, i = argv[i + 1], i + 1
            else:
                raise ValueError("--config: expected a path to a TOML file")
        else:
            rest.append(arg)
        i += 1
    return path, rest


def _normalize_bool_args(args: list[str]) -> list[str]:
    """Accept --flag true/false (and --flag=false) besides tyro's --flag / --no-flag."""
    bools = {p for p, t in leaf_types(JobConfig).items() if t is bool}
    out, i = [], 0
    while i < len(args):
        key, eq, value = args[i].partition("=")
        path = key[2:].replace("-", "_") if key.startswith("--") else None
        if path not in bools:
            out.append(args[i])
            i += 1
            continue
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, eq, i = args[i + 1], "=", i + 1
        if eq:
            if value.lower() not in ("true", "false"):
                raise ValueError(f"{path}: expected true or false, got {value!r}")
            if value.lower() == "false":
                head, _, name = path.rpartition(".")
                path = f"{head}.no_{name}" if head else f"no_{name}"
        out.append(f"--{path}")
        i += 1
    return out


def _tyro_cli(default: JobConfig, args: list[str]) -> JobConfig:
    """tyro.cli on arguments checked first against the fields' types, so that a mistake is one line naming the
    field rather than tyro's multi-line box (tyro has no public hook for its parse errors)."""
    import tyro

    _check_args(args)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            cfg, unknown = tyro.cli(JobConfig, default=default, args=args, prog=_prog(), description=_DESCRIPTION,
                                    return_unknown_args=True)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        raise ValueError(f"invalid arguments: {' '.join(args)} (see --help)") from None
    sys.stderr.write(stderr.getvalue())  # warnings, if any
    if unknown:
        raise ValueError(_unrecognized(unknown))
    return cfg


def _unrecognized(tokens: list[str]) -> str:
    flags = [t for t in tokens if t.startswith("--")]
    token = (flags or tokens)[0]
    msg = f"unrecognized argument '{token}'"
    if flags:
        name = token.partition("=")[0].lstrip("-").replace("-", "_")
        close = difflib.get_close_matches(name, list(leaf_types(JobConfig)), n=1, cutoff=0.6)
        if close:
            msg += f" (did you mean '--{close[0]}'?)"
    return msg


def _check_args(args: list[str]) -> None:
    """Each --field's values against its type: count, number, choice (after _normalize_bool_args)."""
    types_ = leaf_types(JobConfig)
    i = 0
    while i < len(args):
        key, eq, value = args[i].partition("=")
        path = key[2:].replace("-", "_") if key.startswith("--") else None
        i += 1
        if path not in types_ or types_[path] is bool:
            continue  # unknown (tyro returns it, _unrecognized names it), a bool flag, or --help
        values = [value] if eq else []
        while not eq and i < len(args) and not args[i].startswith("--"):
            values.append(args[i])
            i += 1
        tp = types_[path]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            if values == ["None"]:
                continue
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if typing.get_origin(tp) is not tuple:
            if not values:
                raise ValueError(f"{path}: expected 1 value")
            _check_value(path, values[0], tp, f"{path}: {{error}}")
            continue
        item_types = list(typing.get_args(tp))
        if item_types[-1] is Ellipsis:  # any count, none included
            item_types = [item_types[0]] * len(values)
            bad = f"{path}: Could not find valid parse for arguments: {values}"
        else:
            if len(values) < len(item_types):
                raise ValueError(f"{path}: expected {len(item_types)} values")
            names = ", ".join(t.__name__ for t in item_types)
            bad = f"{path}: Could not parse arguments {values} into tuple type typing.Tuple[{names}]"
        for text, item_type in zip(values, item_types):
            _check_value(path, text, item_type, bad)


def _check_value(path: str, text: str, tp: type, bad: str) -> None:
    """``text`` parses as ``tp`` (a number or a choice); else ValueError(bad, with {error} filled in)."""
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        if text not in [str(c) for c in choices]:
            raise ValueError(f"{path}: expected one of {', '.join(repr(c) for c in choices)}, got {text!r}")
    elif tp in (int, float):
        try:
            tp(text)
        except ValueError as e:
            raise ValueError(bad.replace("{error}", str(e))) from None


def _prog() -> str:
    argv0 = sys.argv[0]
    if argv0.endswith("simple_grpo.py"):
        return "python -m torchtitan_rl.simple_grpo"
    return os.path.basename(argv0) or "torchtitan-rl-grpo"
