"""Atomic file writes: a crash or a concurrent reader never sees half a file.

One primitive, :func:`write_bytes_atomic`: the bytes go to ``.<name>.tmp<pid>`` beside the
target, are flushed (and with ``durable`` fsync'd, with the directory), then renamed over
the target, so at any instant the path holds the old file or the new one. Checkpoints,
datasets, metrics and job scripts all go through it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

__all__ = ["write_bytes_atomic", "write_text_atomic", "write_json_atomic", "fsync_dir",
           "SPACE_MARGIN", "check_output_path", "check_writable"]

# Refuse a write that would leave less than this free: a disk filled to the byte hurts everyone.
SPACE_MARGIN = 64 << 10


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_SPECIAL = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
            (stat.S_ISSOCK, "a socket"))


def _not_a_file_to_replace(target: Path, what: str) -> None:
    """Refuse what no write of hvdkit's may replace, and a name no file system takes: every
    write goes to a new file renamed over the target, so ``--metrics-file /dev/null`` would
    put a regular file where the device was (as root, for every program)."""
    from .errors import ConfigError

    with contextlib.suppress(OSError):
        mode = target.stat().st_mode
        kind = next((name for test, name in _SPECIAL if test(mode)), None)
        if kind:
            raise ConfigError(f"{what} {target} is {kind}, not a file: hvdkit writes a new file and renames it "
                              "into place, which would replace it", "name a regular file (or leave the option out)")
    for part in target.parts:
        size = len(os.fsencode(part))
        if size > 255 - 16:  # NAME_MAX, less the room of the temporary file's ".tmp<pid>"
            raise ConfigError(f"{what}: the name {part[:24]}... is {size} bytes, more than a file system takes",
                              "choose a name of at most 200 bytes")


def check_output_path(path: str | os.PathLike[str], what: str) -> Path:
    """A file the user named for hvdkit to write: its directory must exist (hvdkit does not
    create directories for a typo to land in), and it must not be a directory itself, nor a
    device or FIFO, nor a name too long to create."""
    from .errors import ConfigError

    out = Path(path)
    _not_a_file_to_replace(out, what)
    if out.is_dir():
        raise ConfigError(f"{what} {path} is a directory", "name a file in it")
    if not out.parent.is_dir():
        raise ConfigError(f"{what} {path}: the directory {out.parent} does not exist", "create it first")
    check_writable(out, what)  # /proc, read-only, no permission: now, not after the work
    return out


def check_writable(path: str | os.PathLike[str], what: str, directory: bool = False) -> None:
    """Refuse, in one line, a path hvdkit could never write (found before any work, not after
    it): under a file, or where its nearest existing directory refuses a new file (``/proc``,
    read-only, no permission). A probe file is created there and removed at once.
    ``directory``: the path is a directory hvdkit creates (checkpoints, TensorBoard)."""
    import tempfile

    from .errors import ConfigError

    target = Path(path)
    _not_a_file_to_replace(target, what)
    if not directory and target.is_dir():
        raise ConfigError(f"{what} {path} is a directory", "name a file")
    existing = target if directory else target.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{what} {path}: {existing} is a file, not a directory", "choose another path")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".hvdkit-probe-")
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be written: {existing}: {exc.strerror or exc}",
                          "choose a path you can write") from None
    os.close(fd)
    os.unlink(probe)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, *, durable: bool = False,
                       mode: int = 0o644, check_space: bool = False, hold: str | None = None) -> Path:
    """Write ``data`` to ``path`` atomically; ``durable`` also fsyncs the file and its directory.

    ``check_space`` refuses (``ENOSPC``) before writing when the file would not fit with
    :data:`SPACE_MARGIN` to spare. Raises ``OSError``; no temporary file is left behind.
    ``hold`` names the :func:`hvdkit.faults.hold_point` half-way through the write.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    if path.exists() and not path.is_file() and not path.is_dir():  # never rename over a device or FIFO
        raise OSError(errno.EEXIST, f"{path} exists and is not a regular file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if check_space and shutil.disk_usage(path.parent).free < len(data) + SPACE_MARGIN:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            view = memoryview(data)
            if hold:  # the first half, then wait at the hold point, then the rest
                from .faults import hold_point

                first = len(view) // 2
                while first:
                    written = os.write(fd, view[:first])
                    view, first = view[written:], first - written
                hold_point(hold)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if mode & 0o111:
            os.chmod(tmp, mode)  # scripts: executable whatever the umask left of it
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # e.g. ENOTDIR: then no temporary file could exist either
    return path


def write_text_atomic(path: str | os.PathLike[str], text: str, executable: bool = False) -> Path:
    """Write ``text`` atomically (``executable``: mode 755, for scripts)."""
    return write_bytes_atomic(path, text.encode(), mode=0o755 if executable else 0o644)


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> Path:
    """Pretty JSON (non-JSON values as ``str``), written atomically."""
    return write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")
