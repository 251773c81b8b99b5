"""The store's errors, kinds of :class:`wire.errors.UnavailableError`; the tree itself, with the
kinds every package raises, is ``wire.errors``."""

from __future__ import annotations

from wire.errors import NotFoundError, RankscopeError, UnavailableError, UsageError, one_line


class StoreError(UnavailableError):
    """The store could not be opened, written or read; the message says which and why."""


__all__ = ["NotFoundError", "RankscopeError", "StoreError", "UnavailableError", "UsageError", "one_line"]
