"""Merge GPU sections from a benchmarks.md fetched from the device into docs/benchmarks.md.

    python3 scripts/gpu/merge_sections.py /work/.device/.../benchmarks.md [NAME_PART ...]

Only sections whose name says cuda (or GPU) are taken, and with NAME_PARTs
only those whose name contains one of them (a device call's copy also holds
the older GPU sections it did not re-run); each replaces the
section of the same name here or is appended. Every other section of the
local file (the CPU ones) is left as it is.
"""

import re
import sys
from pathlib import Path

SECTION = re.compile(r"<!-- (?P<name>[^/][^>]*?) -->\n.*?<!-- /(?P=name) -->\n", re.S)
LOCAL = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nEvery table: the command that made it, the machine, the date.\n\n"


def main() -> None:
    fetched = Path(sys.argv[1]).read_text()
    text = LOCAL.read_text() if LOCAL.exists() else HEADER
    for m in SECTION.finditer(fetched):
        name = m.group("name")
        if "cuda" not in name and "GPU" not in name:
            continue
        if sys.argv[2:] and not any(part in name for part in sys.argv[2:]):
            continue
        block = m.group(0)
        pattern = re.compile(rf"<!-- {re.escape(name)} -->\n.*?<!-- /{re.escape(name)} -->\n", re.S)
        if pattern.search(text):
            text = pattern.sub(lambda _: block, text)
        else:
            text = text.rstrip() + "\n\n" + block
        print(f"merged: {name}")
    LOCAL.write_text(text)


if __name__ == "__main__":
    main()
