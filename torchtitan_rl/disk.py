"""Writing to disk: folders written whole or not at all, and a write that the file system refused (full, over
quota, read-only) as one line naming the path and its free space.

Each writer of a run (checkpoints, metrics, export, --dry-run) catches its
own failure, cleans up what it had half written, and raises the ValueError
made here, which says what is still valid. The libraries report a full disk
in many ways: OSError 28, a DCP CheckpointException holding it, torch's zip
writer's "unexpected pos", a safetensors "StorageFull"; ``refused`` reads them all.
A folder written at the end (a run's export) can have its room reserved at the
start (``reserve``).
"""

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REFUSED = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded", errno.EFBIG: "file too large",
           errno.EROFS: "read-only file system", errno.EACCES: "permission denied", errno.EPERM: "not permitted"}
"""The errnos a file system refuses a write with, and how the line says it."""
_FULL_TEXT = ("No space left", "StorageFull", "code: 28", "unexpected pos", "Disk quota exceeded")
"""How libraries that drop the errno say the disk is full (safetensors' Rust IoError, torch's zip writer)."""
NEARLY_FULL = 1 << 20
"""Free bytes under which a failed write is taken for a full disk whatever the library said."""


def free_space(path: Path) -> int:
    """Free bytes on the file system of ``path`` (or of its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def refused(error: BaseException, path: Path) -> str | None:
    """Why the file system refused a write to ``path`` ("no space left", "read-only file system", ...), or None
    when ``error`` is something else (a bug keeps its traceback)."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in REFUSED:
            return REFUSED[e.errno]
        if any(text in str(e) for text in _FULL_TEXT):
            return REFUSED[errno.ENOSPC]
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: (exception, frames)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    if isinstance(error, (OSError, RuntimeError)) and free_space(path) < NEARLY_FULL:
        return REFUSED[errno.ENOSPC]
    return None


def write_error(path: Path, why: str, *, doing: str, kept: str, free: int | None = None) -> ValueError:
    """The one line: ``path``: why, while doing what (``free``: bytes free there when it failed, measured now if
    None); what is still valid."""
    free = free_space(path) if free is None else free
    return ValueError(f"{path}: {why} while {doing} ({human(free)} free there); {kept}")


@contextmanager
def complete_or_absent(out: Path) -> Iterator[Path]:
    """A scratch folder that becomes ``out`` only when the block finishes.

    A killed writer leaves ``out`` as it was (absent or empty: callers check)
    and only ``<out>.partial`` behind, which the next attempt clears; a writer
    that fails with an exception (a full disk) leaves no ``.partial``.
    """
    tmp = partial(out)
    if tmp.exists():  # a killed writer's, or reserve()'s room, freed just before the write takes it
        shutil.rmtree(tmp)  # not ignore_errors: a read-only file system says so here
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()  # empty, as the caller checked
    tmp.rename(out)


def partial(out: Path) -> Path:
    """Where complete_or_absent writes ``out`` before renaming it: ``<out>.partial``."""
    return out.with_name(out.name + ".partial")


RESERVED = "reserved"
"""The file in ``<out>.partial`` that holds reserve()'s room: allocated, never written."""


def reserve(out: Path, size: int, *, kept: str) -> None:
    """Hold ``size`` bytes on ``out``'s file system until complete_or_absent(out) writes there: a disk that fills
    meanwhile still has the room. The room is ``<out>.partial/reserved``, which complete_or_absent clears first;
    ``release`` gives it back unused. A file system without the room refuses now, in one line (``kept``: what is
    still valid)."""
    tmp = partial(out)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        fd = os.open(tmp / RESERVED, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # blocks taken, no bytes written (glibc emulates it where unsupported)
        finally:
            os.close(fd)
    except OSError as e:
        release(out)
        if (why := refused(e, out)) is None:
            raise
        raise write_error(out, why, doing=f"reserving the {human(size)} its export will take", kept=kept) from None


def release(out: Path) -> None:
    """Give back reserve()'s room for ``out`` (a run that ends without exporting); nothing if it was used."""
    if (partial(out) / RESERVED).is_file():
        shutil.rmtree(partial(out), ignore_errors=True)
