"""A write that fails because the disk is full: told in one line (the path, the step, the bytes free and an estimate
of the bytes needed) instead of a library's traceback, whichever writer ran out of space.

A full disk (a checkpoint, the export, the data cache, the tokenizer) ends the run with exit code 5 (exits.py).
What every rank writes into (a checkpoint's .partial) is agreed on by every rank after the write
(ranks.written_by_all), so one rank's failure never leaves the others in a barrier.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from .config import nearest_existing


class DiskFull(RuntimeError):
    """A write ran out of space; the message is the line to print (empty on a rank that only learnt of it)."""


FULL_ERRNOS = (28, 122)   # ENOSPC, EDQUOT (a quota counts as full)
# the same errors as the Rust writers word them, in exceptions that carry no errno: safetensors' SafetensorError
# ("I/O error: No space left on device (os error 28)"), tokenizers' plain Exception
FULL_WORDS = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


def disk_full(err: BaseException, path: Path, what: str, step: int, needed: tuple[int, str] | None,
              then: str) -> DiskFull | None:
    """`err`, raised writing `what` into `path`, as a DiskFull with its line when the disk was full, else None.
    An OSError says so (ENOSPC, EDQUOT), and so does the text of the Rust writers' errors (FULL_WORDS);
    torch.save's RuntimeError ("unexpected pos", "file write failed") loses both, so an OSError or a
    RuntimeError counts as full when the filesystem has less free space than was needed
    (`needed`: (bytes, how they were estimated)), or under 1 MiB when that is not known. then: what
    became of the run and what to do, the line's end."""
    import shutil

    path = Path(getattr(err, "filename", None) or path)
    free = shutil.disk_usage(nearest_existing(path)).free
    need, how = needed or (0, "")
    said_full = any((isinstance(e, OSError) and e.errno in FULL_ERRNOS) or any(w in str(e) for w in FULL_WORDS)
                    for e in _causes(err))   # datasets wraps the OSError in its DatasetGenerationError
    if not said_full and not (isinstance(err, (OSError, RuntimeError)) and free < max(need, 1 << 20)):
        return None
    wanted = f"about {_size(need)} needed ({how})" if need else "the bytes needed are not known"
    return DiskFull(f"[disk full] {what} at step {step} could not be written to {path}: {_size(free)} free on its "
                    f"filesystem, {wanted}; {then}")


def fullest(*paths: Path) -> Path:
    """Of the places a block writes to, the one whose filesystem has the least free space."""
    import shutil
    return min(paths, key=lambda p: shutil.disk_usage(nearest_existing(p)).free)


def _causes(err: BaseException | None):
    """`err` and the exceptions it was raised from or during, innermost last."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


@contextlib.contextmanager
def full_disk_is_one_line(what: str, path: Path, step: int, needed, then: str):
    """The block's write error as a DiskFull with its line when the disk was full (disk_full), else as it
    was. For writes one rank makes while the others wait for its result (rank 0's data cache and
    tokenizer: ranks.main_first shares the error). needed: (bytes, how), or a callable giving it."""
    try:
        yield
    except Exception as err:   # noqa: BLE001 - disk_full tells a full disk from the rest, which is raised as it was
        if isinstance(err, DiskFull):
            raise
        full = disk_full(err, path, what, step, needed() if callable(needed) else needed, then)
        if full is None:
            raise
        raise full from None


def _size(n_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n_bytes < 1024 or unit == "GiB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1024
