"""The places a run creates: whether it can (a name the OS refuses, a directory that cannot be written), and one
line when creating one fails anyway.

A path component longer than its filesystem allows (os.pathconf PC_NAME_MAX, 255 bytes on ext4, xfs and
tmpfs) or a whole path over PC_PATH_MAX (4096 bytes on Linux) is refused by the kernel only when something is
created there (`OSError: [Errno 36] File name too long`), after the run has made the directories above it.
preflight checks every path key for both before anything is created, and whether the nearest existing directory
above each place can be written (check_writable_dir: not a file, not a read-only mount or a pseudo-filesystem);
`make_place` turns any OSError from creating one of the run's places into one `config error:` line naming the key
and the path.
"""
from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from .config import ConfigError, nearest_existing, path_kind

DEFAULT_NAME_MAX, DEFAULT_PATH_MAX = 255, 4096   # Linux's, where pathconf cannot tell
_FULL = {errno.ENOSPC, errno.EDQUOT}             # a full disk is disk.disk_full's line, with the sizes


def _deepest_existing(path: Path) -> Path:
    """The deepest ancestor of `path` (absolute) that exists: the filesystem its new components land on.
    Walked down from the root, so a component that is itself too long is never handed to stat."""
    here = Path(path.anchor)
    for part in path.parts[1:]:
        try:
            if not (here / part).exists():
                break
        except OSError:   # ENAMETOOLONG, a file above it: the components from here on are new
            break
        here = here / part
    return here


def _limits(directory: Path) -> tuple[int, int]:
    """(PC_NAME_MAX, PC_PATH_MAX) of the filesystem holding `directory`."""
    out = []
    for name, default in (("PC_NAME_MAX", DEFAULT_NAME_MAX), ("PC_PATH_MAX", DEFAULT_PATH_MAX)):
        try:
            out.append(os.pathconf(directory, name))
        except (OSError, ValueError):
            out.append(default)
    return out[0], out[1]


def check_name_limits(key: str, path: str | Path) -> None:
    """One config error line when `path` cannot exist on its filesystem: a component over the name limit
    (bytes, as the kernel counts them) or the whole path over the path limit."""
    full = Path(path).expanduser().absolute()
    name_max, path_max = _limits(_deepest_existing(full))
    for part in full.parts[1:]:
        size = len(os.fsencode(part))
        if size > name_max:
            shown = part if len(part) <= 40 else f"{part[:20]}...{part[-12:]}"
            raise ConfigError(f"{key}={path}: its component '{shown}' is {size} bytes, over the {name_max} its "
                              "filesystem allows in one name (os.pathconf PC_NAME_MAX): give a shorter name")
    size = len(os.fsencode(str(full)))
    if size >= path_max:   # PC_PATH_MAX counts the terminating NUL
        raise ConfigError(f"{key}={path}: the path is {size} bytes, over the {path_max - 1} its filesystem allows "
                          "(os.pathconf PC_PATH_MAX): give a shorter path")


def check_path_names(paths: list[tuple[str, object]]) -> None:
    """check_name_limits for every (key, value) given (preflight.path_values: the set path keys of one kind, in
    config.PATH_KEYS's order): a value is a path, a list of them, or unset (None, "auto"); a Hub name passes
    (no such path on disk: nothing over a limit)."""
    for key, value in paths:
        for path in (value or []) if isinstance(value, list) else [value] if value not in (None, "auto") else []:
            check_name_limits(key, path)


@contextlib.contextmanager
def creating(key: str, path: str | Path):
    """Around the code that creates one of the run's places: an OSError (other than a full disk, which is
    disk.disk_full's line) becomes one config error line naming the key and the path."""
    try:
        yield
    except OSError as err:
        if err.errno in _FULL:
            raise
        where = f" ({err.filename})" if err.filename and str(err.filename) != str(path) else ""
        raise ConfigError(f"{key}={path}: cannot be created{where}: {err.strerror or err}; give another path") from None


def make_place(key: str, path: str | Path) -> Path:
    """mkdir -p `path` for `key`, one config error line when the OS refuses it."""
    with creating(key, path):
        Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)


# ---------------------------------------------------------------------------- directories a run can write
def check_writable_dir(path: Path, key: str) -> None:
    """`path` is a directory, or can be made one: its nearest existing ancestor is a writable directory."""
    path = Path(path)
    if path_kind(path, key) == "file":
        raise ConfigError(f"{key}={path} is a file, not a directory: give a directory path (it is created if missing)")
    existing = nearest_existing(path)
    if not existing.is_dir():
        raise ConfigError(f"{key}={path}: {existing} is a file, so the directory cannot be created there; "
                          "give another path")
    problem = cannot_create_in(existing)
    if problem:
        raise ConfigError(f"{key}={path}: nothing can be created in {existing} ({problem}); give a writable path")


def unwritable_default(path: Path) -> str | None:
    """Why a directory the user never named (a library's default cache) cannot be written: None when it can."""
    try:
        check_writable_dir(path, "")
    except ConfigError as err:
        return str(err).lstrip("=")
    return None


def cannot_create_in(directory: Path) -> str | None:
    """Why no file can be created in `directory`, or None when one can: a probe file is created and removed
    (the only thing a check writes), and the directory's times are set back, so the check leaves no trace.
    os.access cannot tell: root passes it everywhere, yet a read-only mount or a pseudo-filesystem (/proc,
    /sys) refuses the write itself."""
    import tempfile
    try:
        before = os.stat(directory)
        fd, probe = tempfile.mkstemp(prefix=".bert-recipes-probe-", dir=directory)
    except OSError as err:
        fs_type, options = filesystem_of(directory)
        why = ("it is mounted read-only" if "ro" in options else f"it is on a {fs_type} filesystem"
               if fs_type in PSEUDO_FILESYSTEMS else "this user may not write there")
        return f"{why}: {err.strerror or type(err).__name__}"
    os.close(fd)
    os.unlink(probe)
    try:
        os.utime(directory, ns=(before.st_atime_ns, before.st_mtime_ns))
    except OSError:
        pass   # a directory this user may write in but not touch: the probe is gone all the same
    return None


PSEUDO_FILESYSTEMS = {"proc", "sysfs", "devpts", "cgroup", "cgroup2", "debugfs", "securityfs", "tracefs", "configfs"}


def filesystem_of(path: Path) -> tuple[str, set[str]]:
    """(type, mount options) of the filesystem holding `path`, from /proc/self/mounts (the longest mount point
    above it); ("unknown", set()) where that cannot be read."""
    try:
        mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return "unknown", set()
    target = Path(path).resolve()
    best = max((m for m in mounts if len(m) >= 4 and (target == Path(m[1]) or Path(m[1]) in target.parents)),
               key=lambda m: len(m[1]), default=None)
    return (best[2], set(best[3].split(","))) if best else ("unknown", set())
