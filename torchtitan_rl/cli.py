"""What every command of this package does with a user's mistake."""

import sys
from contextlib import contextmanager


@contextmanager
def one_line_errors():
    """A ValueError (a user error: it names the field, file or tensor) ends the command with one line, exit 2."""
    try:
        yield
    except ValueError as e:
        print(f"torchtitan_rl: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
