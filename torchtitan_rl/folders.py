"""Folders written whole or not at all (the fetched model, an exported policy)."""

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def complete_or_absent(out: Path) -> Iterator[Path]:
    """A scratch folder that becomes ``out`` only when the block finishes.

    A killed writer leaves ``out`` as it was (absent or empty: callers check)
    and only ``<out>.partial`` behind, which the next attempt clears; a writer
    that fails with an exception (a full disk) leaves no ``.partial``.
    """
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()  # empty, as the caller checked
    tmp.rename(out)
