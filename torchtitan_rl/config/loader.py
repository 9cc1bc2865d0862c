"""Former home of the config's TOML I/O, validation and CLI; kept so existing imports work.

New code imports from toml_io.py, validation.py and cli.py (or torchtitan_rl.config).
"""

from torchtitan_rl.config.cli import parse_args
from torchtitan_rl.config.toml_io import from_dict, load_toml, to_toml, write_toml
from torchtitan_rl.config.validation import (
    check_serve,
    config_diff,
    effective_task,
    redacted_dict,
    tokenizer_dir,
    validate,
)

__all__ = ["check_serve", "config_diff", "effective_task", "from_dict", "load_toml", "parse_args",
           "redacted_dict", "to_toml", "tokenizer_dir", "validate", "write_toml"]
