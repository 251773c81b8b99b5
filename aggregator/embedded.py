"""Opening a chDB data directory: what to refuse before chDB touches it, and why an open failed.

chDB creates any directory it is given and fills it with a store, prints some of its errors straight
to the process's stderr (file descriptor 2, not ``sys.stderr``) and explains others with its C++
stack trace. :meth:`aggregator.Store.embedded` uses these helpers so that each problem becomes one
``StoreError`` that names it: a path that is a file, a directory that holds something else, a store
another process holds.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
import tempfile
from collections.abc import Iterator

from rankscope.wire.errors import one_line


def is_data_dir(path: str) -> bool:
    """Whether ``path`` is a chDB (ClickHouse) data directory: chDB makes ``metadata/`` on first open."""
    return os.path.isdir(os.path.join(path, "metadata"))


def path_problem(path: str, create: bool) -> str | None:
    """Why chDB must not open ``path``, or None.

    Refused: a path that is not a directory; a directory holding files but no chDB store (chDB would
    make one among them); with ``create`` False, a path with no store at all.
    """
    if os.path.lexists(path) and not os.path.isdir(path):
        return f"the store path {path} is not a directory"
    if not os.path.isdir(path):
        return None if create else f"there is no store at {path}"
    if is_data_dir(path):
        return None
    try:
        empty = not any(os.scandir(path))
    except OSError as exc:
        return f"cannot read the store directory {path}: {exc.strerror}"
    if not create:
        return f"{path} is not a rankscope store (it holds no chDB data)"
    if not empty:
        return f"{path} is a directory that holds no chDB store: give a new or empty directory, or the store's own"
    return None


@contextlib.contextmanager
def fd2_captured(into: list[bytes]) -> Iterator[None]:
    """Send what is written to file descriptor 2 meanwhile into ``into`` instead of the terminal.

    What chDB prints there when an open fails (``Cannot lock file …``) explains the failure; on
    success it is written out after all, so nothing is hidden. Output of other threads in the
    meantime is held back and written out the same way.
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no fd 2 (a daemon), or sys.stderr is None
        yield
        return
    failed = False
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            data = tmp.read()
            into.append(data)
            if data and not failed:
                with contextlib.suppress(OSError):
                    os.write(2, data)


def _locked(path: str) -> bool:
    """Whether another process holds chDB's lock on the data directory ``path`` (its ``status`` file)."""
    try:
        fd = os.open(os.path.join(path, "status"), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError as exc:
        return exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK)
    finally:
        os.close(fd)  # also releases the shared lock, if taken


def open_problem(path: str, exc: BaseException, printed: bytes) -> str:
    """One line saying why chDB could not open ``path``; ``printed`` is what it wrote to stderr."""
    said = printed.decode("utf-8", "replace")
    if "Cannot lock file" in said or _locked(path):
        return (
            f"the store {path} is in use by another process: chDB lets one process at a time open a data "
            "directory; stop that process or wait for it to finish, or give another directory"
        )
    reason = one_line(f"{exc} {said}")
    return (
        f"cannot open the chDB store at {path}: {reason}. chDB allows one data directory per process, and "
        "one process per directory: close the other Store, or stop the other process"
    )
