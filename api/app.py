"""The FastAPI application: the diagnosis API under ``/api/v1``, the web page, health and metrics.

Errors are one line each, ``{"detail": ...}``, with the status :data:`STATUS` gives their kind of
:class:`wire.errors.RankscopeError` (a parameter FastAPI refuses is 422); anything else is 500 with
its one-line cause, never a traceback.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rankscope.wire.errors import (
    Forbidden,
    NotFoundError,
    RankscopeError,
    Unauthenticated,
    UnavailableError,
    UsageError,
    one_line,
)

from . import pages
from .auth import Tokens
from .routes import jobs, ops, tickets
from .service import Service

log = logging.getLogger(__name__)

STATUS: dict[type[RankscopeError], int] = {
    UsageError: 400,
    Unauthenticated: 401,
    Forbidden: 403,
    NotFoundError: 404,
    UnavailableError: 503,
    RankscopeError: 503,  # another kind: the service cannot answer it now
}
"""The HTTP status of each kind of error, the first of the error's classes (its MRO) listed."""


def status_of(exc: RankscopeError) -> int:
    return next(STATUS[k] for k in type(exc).__mro__ if k in STATUS)


def create_app(service: Service, tokens: Tokens | None = None) -> FastAPI:
    app = FastAPI(
        title="rankscope",
        summary="Which GPU, NIC, host or code path makes a training job slow or hangs it",
        version="1",
    )
    app.state.service = service
    app.state.tokens = tokens or Tokens({})
    for router in (jobs.router, tickets.router, ops.router, pages.router):
        app.include_router(router)

    @app.exception_handler(RankscopeError)
    def answer(request: Request, exc: RankscopeError) -> JSONResponse:
        status = status_of(exc)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse({"detail": one_line(str(exc))}, status_code=status, headers=headers)

    @app.exception_handler(Exception)
    def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("rankscope serve: %s %s failed", request.method, request.url.path)
        return JSONResponse({"detail": one_line(f"{type(exc).__name__}: {exc}")}, status_code=500)

    return app
