"""The one place stagetool writes files: a reader never sees a half-written report, snapshot or JUnit
file, and nothing but the path asked for is touched.

* A **regular file** (or a new path) is written to a temporary file in the same folder, flushed to
  disk and renamed over the path (``os.replace``), keeping the old file's mode (and owner, where
  allowed). The temporary file is removed on every exit path, signals included
  (:mod:`stagetool.core.cleanup`).
* A **symlink** is followed: its target is replaced, the link stays a link.
* **Anything else** that exists — a character device (``/dev/null``), a FIFO, a terminal,
  ``/dev/stdout`` — is opened and written in place: never renamed over, never read first.
* A **read-modify-write** (``check --update`` of a shared baseline) holds an exclusive lock
  (:func:`locked`) so that concurrent updates of different functions all land.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import Iterator

from stagetool.core import cleanup


def is_special(path: str | Path) -> bool:
    """True when ``path`` exists and is not a regular file or folder (a device, FIFO, socket,
    ``/dev/stdout``): such a path is written in place and never read first."""
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except OSError:
        return False
    if stat.S_ISDIR(st.st_mode):
        return False
    return not stat.S_ISREG(st.st_mode) or _through_dev(p)


def _through_dev(p: str) -> bool:
    # /dev/stdout, /dev/fd/1, /proc/self/fd/1 name an open file of this process, whatever it is:
    # write through the name (as a shell's `>` does), never rename over what it resolves to.
    a = os.path.abspath(p)
    return a.startswith(("/dev/", "/proc/"))


def write_problem(path: str | Path) -> str | None:
    """Why :func:`write_atomic` could not write ``path``, or None when it can: checked before a run
    stages anything, so that a bad ``-o`` is a usage error rather than a compile thrown away.

    A special file (``/dev/stdout``) is written in place and is not probed. Otherwise the folder
    must exist, be a folder, and take a new file: a temporary file is created in it and removed
    (a real write, because ``os.access`` says yes to root even where the write fails, e.g. in
    ``/sys`` or on a read-only mount).
    """
    p = Path(path)
    if is_special(p):
        return None
    if p.is_dir():
        return f"{p} is a folder; give a file name"
    parent = p.parent
    if not parent.exists():
        return f"the folder {parent} does not exist"
    if not parent.is_dir():
        return f"{parent} is not a folder"
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".stagetool-probe-")
    except OSError as e:
        return f"cannot create a file in {parent}: {e.strerror or e}"
    os.close(fd)
    os.unlink(probe)
    return None


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path``: atomically for a regular file, in place for anything else.

    Raises:
      OSError: the folder does not exist or is not writable, or ``path`` is a folder; the target is
        left untouched (a regular file), and no temporary file is left behind.
    """
    p = os.fspath(path)
    data = text.encode("utf-8")
    try:
        st: os.stat_result | None = os.stat(p)  # follows symlinks
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", p)
    if st is not None and (not stat.S_ISREG(st.st_mode) or _through_dev(p)):
        _write_in_place(p, data, truncate=stat.S_ISREG(st.st_mode))
        return
    _replace(os.path.realpath(p), data, st)


def _write_in_place(p: str, data: bytes, *, truncate: bool) -> None:
    # No O_CREAT (it exists), no O_TRUNC on a device or FIFO; opening a FIFO waits for a reader, as `>` does.
    fd = os.open(p, os.O_WRONLY | os.O_CLOEXEC | (os.O_TRUNC if truncate else 0))
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    finally:
        os.close(fd)


def _replace(real: str, data: bytes, st: os.stat_result | None) -> None:
    folder = os.path.dirname(real) or "."
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(real)}.", suffix=".tmp", dir=folder)
    token = cleanup.register_path(tmp)
    try:
        try:
            # mkstemp makes the file owner-only; give it the mode a plain open() would (0666 less
            # umask), or keep the mode (and owner, where allowed) of the file it replaces.
            if st is not None:
                os.fchmod(fd, stat.S_IMODE(st.st_mode))
                if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
                    with contextlib.suppress(OSError):
                        os.fchown(fd, st.st_uid, st.st_gid)
            else:
                umask = os.umask(0)
                os.umask(umask)
                os.fchmod(fd, 0o666 & ~umask)
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, real)
        _fsync_folder(folder)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        cleanup.forget(token)


def _fsync_folder(folder: str) -> None:
    with contextlib.suppress(OSError):
        dfd = os.open(folder, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


@contextlib.contextmanager
def locked(path: str | Path) -> Iterator[None]:
    """Hold an exclusive lock for a read-modify-write of ``path`` (a baseline).

    The lock is ``flock`` on the folder that holds ``path``'s target (no lock file is created, and
    it survives the atomic rename of the file itself); every ``stagetool check --update`` of a file
    in that folder waits for the others. A path written in place (a device) is not locked.
    """
    p = os.fspath(path)
    if is_special(p):
        yield
        return
    import fcntl

    folder = os.path.dirname(os.path.realpath(p)) or "."
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        yield  # the write reports the folder's problem
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
