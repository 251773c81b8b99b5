"""Hooks the script never closed are closed when the process ends, so their last steps ship, and
each rank's exit record says how it ended.

* At a normal exit (or one on an uncaught exception: ``sys.excepthook`` tells the hooks which,
  then prints it as before): ``atexit``.
* On SIGTERM, when the script left it to the default (torchrun stops a failed attempt's surviving
  workers so): the steps since the last flush are what a restart's redone work is measured by.
  The process then dies as it would have. A Python signal handler runs only when the main thread
  runs Python again, and a worker stuck in a collective (a peer died) may not for minutes, where
  the default would have ended it at once. So the signal also wakes a thread of ours (through
  ``signal.set_wakeup_fd``) that closes the hooks and ends the process itself (exit status 143,
  the shell's 128 + SIGTERM). Whichever comes first does it. If the script installs its own
  SIGTERM handler later, or something else owns the wakeup fd (asyncio), the signal is theirs.
* A SIGTERM that comes while a hook is closing waits for that close (up to ``CLOSE_S``). A worker
  whose peer died may have its collective raise, and be closing at exit when torchrun's SIGTERM
  comes: ending it there lost a failed attempt's last steps in one CI run of the restart test.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

CLOSE_S = 2.0
"""How long closing at exit may take, for all open hooks together."""

_open: weakref.WeakSet[Any] = weakref.WeakSet()
_installed = False
_dying = threading.Lock()
_closes = threading.Condition()
_closing: dict[int, int] = {}
"""Closes in progress, per thread id."""
_term_pending = False
"""A SIGTERM came while the main thread was closing a hook: it dies once that close ends."""
_signalled = 0
"""The signal that ends the process (0: none), for the hooks' exit records."""


def signalled() -> int:
    """The signal that ends this process, if one does (SIGTERM: torchrun stopping the workers)."""
    return _signalled


def closing_at_exit(hook: Any) -> None:
    """Close ``hook`` (a ``Hook``) when the process ends, unless the script closes it first."""
    global _installed
    if not _installed:
        _installed = True
        atexit.register(_close_open)
        _watch_sigterm()
        _watch_exceptions()
    _open.add(hook)


def _watch_exceptions() -> None:
    """An exception that ends the script is told to the open hooks (their exit records carry it),
    then to whatever ``sys.excepthook`` was (it prints the traceback)."""
    theirs = sys.excepthook

    def excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        for hook in list(_open):
            with contextlib.suppress(Exception):
                hook.failed(exc)
        theirs(kind, exc, tb)

    sys.excepthook = excepthook


@contextlib.contextmanager
def closing(hook: Any) -> Iterator[None]:
    """Around a hook's close: a SIGTERM meanwhile waits for it instead of cutting it short."""
    _open.discard(hook)
    me = threading.get_ident()
    with _closes:
        _closing[me] = _closing.get(me, 0) + 1
    try:
        yield
    finally:
        with _closes:
            _closing[me] -= 1
            if not _closing[me]:
                del _closing[me]
            _closes.notify_all()
        if _term_pending and me not in _closing and me == threading.main_thread().ident:
            # The SIGTERM this close deferred: our thread, if it woke, ends the process now that
            # the close is done (exit status 143); else the signal's default action does.
            _dying.acquire(timeout=CLOSE_S)
            _die()


def _close_open() -> None:
    deadline = time.monotonic() + CLOSE_S
    for hook in list(_open):
        hook.close(max(0.1, deadline - time.monotonic()))
    me = threading.get_ident()
    with _closes:  # closes begun elsewhere (at exit, or by the script) finish first
        _closes.wait_for(lambda: set(_closing) <= {me}, max(0.0, deadline - time.monotonic()))


def _watch_sigterm() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set a signal handler
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # the script's own
    signal.signal(signal.SIGTERM, _on_sigterm)
    r, w = os.pipe()
    os.set_blocking(w, False)
    theirs = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    if theirs != -1:  # someone else's (asyncio's): give it back
        signal.set_wakeup_fd(theirs)
        os.close(r)
        os.close(w)
        return
    threading.Thread(target=_wake_on_sigterm, args=(r,), name="rankscope-sigterm", daemon=True).start()


def _wake_on_sigterm(r: int) -> None:
    while data := os.read(r, 64):  # one byte per signal that has a Python handler
        ours = signal.SIGTERM in data and signal.getsignal(signal.SIGTERM) is _on_sigterm
        if ours and _dying.acquire(blocking=False):
            _note_signal()
            with contextlib.suppress(Exception):
                _close_open()
            os._exit(128 + signal.SIGTERM)


def _note_signal() -> None:
    global _signalled
    _signalled = signal.SIGTERM


def _on_sigterm(signum: int, frame: object) -> None:
    global _term_pending
    _note_signal()
    if threading.get_ident() in _closing:  # interrupted its own close: let it finish first
        _term_pending = True
        return
    if not _dying.acquire(blocking=False):
        return  # the thread is on it
    with contextlib.suppress(Exception):
        _close_open()
    _die()


def _die() -> None:
    """End the process as SIGTERM's default action would have."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
