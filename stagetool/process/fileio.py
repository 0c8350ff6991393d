"""The one place stagetool writes files: a reader never sees a half-written report, snapshot or JUnit
file, and nothing but the path asked for is touched.

* A **regular file** (or a new path) is written to a temporary file in the same folder, flushed to
  disk and renamed over the path (``os.replace``), keeping the old file's mode (and owner, where
  allowed). The temporary file is removed on every exit path, signals included
  (:mod:`stagetool.process.cleanup`).
* A **symlink** is followed: its target is replaced, the link stays a link — unless the caller
  asks for ``follow_symlinks=False`` (the pytest plugin's snapshots): then a link, a file that is
  not regular, or one another user owns is refused, and the rename replaces the path itself (a
  link swapped in after the check is replaced, never written through).
* **Anything else** that exists — a character device (``/dev/null``), a FIFO, a terminal,
  ``/dev/stdout`` — is opened and written in place: never renamed over, never read first.
* A **read-modify-write** (``check --update`` of a shared baseline) holds an exclusive lock
  (:func:`locked`) so that concurrent updates of different functions all land.
* The temporary file is named ``.<name>.<pid>.<random>.tmp``: one left by a run that was killed
  (``kill -9``, a power cut) is removed by the next write of the same file, once no process of
  that pid is alive, a zombie counting as dead (:func:`_remove_stray`).

Reading a file the user names (a spec, a baseline, a sweep document) goes through
:func:`read_regular_bytes`: a FIFO, a device (``/dev/zero``), a socket or a folder is refused
without reading from it (no hang, no endless read), and so is a file over a size limit.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import Iterator

from stagetool.process import cleanup


class FileProblem(Exception):
    """A path that is not a readable regular file of a sensible size (see :func:`read_regular_bytes`);
    the message says what it is (``is a FIFO``, ``is larger than 64 MiB``)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def read_regular_bytes(path: str | Path, *, max_bytes: int, follow_symlinks: bool = True) -> bytes:
    """The bytes of ``path``, which must be a regular file of at most ``max_bytes`` bytes.

    The file is opened with ``O_NONBLOCK`` (a FIFO's open does not wait for a writer) and checked
    with ``fstat`` on the open descriptor before one byte is read; with ``follow_symlinks=False`` it
    is opened with ``O_NOFOLLOW`` (a symbolic link is refused). At most ``max_bytes + 1`` bytes are
    read, so a file that grows while it is read is refused too.

    Raises:
      FileNotFoundError / PermissionError / OSError: it cannot be opened.
      FileProblem: it is a FIFO, device, socket, folder or link (not followed), or larger than
        ``max_bytes``.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(os.fspath(path), flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_symlinks:
            raise FileProblem("is a symbolic link") from None
        if e.errno == errno.ENXIO:  # a socket, or a FIFO opened for writing only
            raise FileProblem("is not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileProblem(f"is {_kind(st.st_mode)}")
        if st.st_size > max_bytes:
            raise FileProblem(f"is larger than {_size(max_bytes)} ({st.st_size} bytes)")
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:
            raise FileProblem(f"is larger than {_size(max_bytes)}")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_regular_text(path: str | Path, *, max_bytes: int, follow_symlinks: bool = True) -> str:
    """:func:`read_regular_bytes` decoded as UTF-8 (``UnicodeDecodeError``, a ``ValueError``, if it is not)."""
    return read_regular_bytes(path, max_bytes=max_bytes, follow_symlinks=follow_symlinks).decode("utf-8")


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n % 2**20 == 0 else f"{n} bytes"


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


def write_atomic(path: str | Path, text: str, *, follow_symlinks: bool = True) -> None:
    """Write ``text`` (UTF-8) to ``path``: atomically for a regular file, in place for anything else.

    With ``follow_symlinks=False``, only a regular file this user owns (or a new path) is written,
    atomically, at ``path`` itself: never through a link, never a device.

    Raises:
      OSError: the folder does not exist or is not writable, or ``path`` is a folder; the target is
        left untouched (a regular file), and no temporary file is left behind.
      FileProblem: (``follow_symlinks=False``) ``path`` is a symbolic link, not a regular file, or
        owned by another user; nothing is written.
    """
    p = os.fspath(path)
    data = text.encode("utf-8", "backslashreplace")  # a lone surrogate from user code (a dict key) as \udXXX
    if not follow_symlinks:
        _replace(os.path.abspath(p), data, owned_regular_or_none(p))
        return
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


def owned_regular_or_none(path: str | Path) -> os.stat_result | None:
    """``lstat`` of ``path`` when it is a regular file this user owns; None when nothing is there.

    Raises:
      FileProblem: it is a symbolic link, a folder, a device, a FIFO, or another user's file.
    """
    try:
        st = os.lstat(os.fspath(path))
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise FileProblem(f"is {_kind(st.st_mode)}")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise FileProblem(f"is owned by another user (uid {st.st_uid})")
    return st


def owned_folder(path: str | Path) -> None:
    """Make the folder ``path`` (its parent must exist) or check the one there: a real folder this
    user owns, not a symbolic link to one.

    Raises:
      FileProblem: ``path`` is a link, a file, or a folder of another user.
      OSError: it cannot be made.
    """
    p = os.fspath(path)
    with contextlib.suppress(FileExistsError):
        os.mkdir(p, 0o777)
    st = os.lstat(p)
    if not stat.S_ISDIR(st.st_mode):
        raise FileProblem(f"is {_kind(st.st_mode)}, not a folder")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise FileProblem(f"is a folder owned by another user (uid {st.st_uid})")


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
    _remove_stray(folder, os.path.basename(real))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(real)}.{os.getpid()}.", suffix=".tmp", dir=folder)
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


def _remove_stray(folder: str, name: str) -> None:
    """Remove ``.<name>.<pid>.*.tmp`` files in ``folder`` that this user owns and whose writer (the
    process ``pid``) is no longer alive: what a killed run left. Nothing else is touched."""
    import re

    pattern = re.compile(r"\." + re.escape(name) + r"\.(\d+)\.[A-Za-z0-9_]+\.tmp\Z")
    try:
        entries = os.listdir(folder)
    except OSError:
        return
    for entry in entries:
        m = pattern.match(entry)
        if m is None or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        path = os.path.join(folder, entry)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(path)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` may still write: it exists and is not a zombie (a writer killed but
    not yet reaped by its parent writes nothing more; on Linux its ``/proc/PID/stat`` state says so)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # another user's process (or not ours to judge): leave its file
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


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
