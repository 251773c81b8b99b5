"""Bearer tokens with a read or a write scope (write includes read), compared in constant time.

Tokens come from a file (one ``TOKEN SCOPE`` per line, ``#`` comments) and/or ``$RANKSCOPE_TOKENS``
(``TOKEN:SCOPE,TOKEN:SCOPE``). With no tokens at all every request is allowed: ``rankscope serve``
then refuses to listen beyond loopback unless told ``--insecure``.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from fastapi import Request

from rankscope.wire.errors import Forbidden, Unauthenticated, UsageError

Scope = Literal["read", "write"]
SCOPES: tuple[Scope, ...] = ("read", "write")


class Tokens:
    def __init__(self, tokens: dict[str, Scope]) -> None:
        self._tokens = list(tokens.items())

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    @classmethod
    def load(cls, path: str | None = None, env: str | None = None) -> Tokens:
        env = os.environ.get("RANKSCOPE_TOKENS", "") if env is None else env
        pairs: list[tuple[str, str, str]] = []
        if path:
            try:
                text = Path(path).read_text(encoding="utf-8")
            except OSError as exc:
                raise UsageError(f"cannot read the tokens file {path}: {exc.strerror}") from exc
            for n, line in enumerate(text.splitlines(), 1):
                line = line.split("#", 1)[0].strip()
                if line:
                    token, _, scope = line.partition(" ")
                    pairs.append((token, scope.strip(), f"{path}:{n}"))
        for n, item in enumerate(filter(None, (i.strip() for i in env.split(","))), 1):
            token, _, scope = item.rpartition(":")
            pairs.append((token, scope, f"$RANKSCOPE_TOKENS item {n}"))
        tokens: dict[str, Scope] = {}
        for token, scope, where in pairs:
            if scope not in SCOPES or len(token) < 16:
                raise UsageError(f"{where}: expected a token of 16+ characters and a scope read or write")
            tokens[token] = scope  # type: ignore[assignment]
        return cls(tokens)

    def scope_of(self, presented: str) -> Scope | None:
        found: Scope | None = None
        for token, scope in self._tokens:  # every token compared: the time tells nothing
            if hmac.compare_digest(token.encode(), presented.encode()):
                found = scope
        return found

    def require(self, needed: Scope) -> Callable[[Request], None]:
        """A FastAPI dependency: 401 without a known token, 403 when its scope is too small."""

        def check(request: Request) -> None:
            if not self.enabled:
                return
            header = request.headers.get("authorization", "")
            presented = header[7:] if header.lower().startswith("bearer ") else ""
            presented = presented or request.cookies.get("rankscope_token", "")
            scope = self.scope_of(presented) if presented else None
            if scope is None:
                raise Unauthenticated("a bearer token is required")
            if needed == "write" and scope != "write":
                raise Forbidden("this token has the read scope; this needs write")

        return check


def need_read(request: Request) -> None:
    """Dependency: the app's tokens (``app.state.tokens``) must grant read."""
    request.app.state.tokens.require("read")(request)


def need_write(request: Request) -> None:
    """Dependency: the app's tokens must grant write."""
    request.app.state.tokens.require("write")(request)
