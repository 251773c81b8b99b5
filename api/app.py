"""The FastAPI application: the diagnosis API under ``/api/v1``, the web page, health and metrics.

Errors are one line each: an unknown job or ticket is 404, a bad parameter 422, a store that cannot
be read 503 with the reason; anything else 500 with its one-line cause, never a traceback.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from aggregator import RankscopeError
from aggregator.errors import one_line

from . import pages
from .auth import Tokens
from .routes import jobs, ops, tickets
from .service import Service

log = logging.getLogger(__name__)


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
    def store_problem(request: Request, exc: RankscopeError) -> JSONResponse:
        return JSONResponse({"detail": one_line(str(exc))}, status_code=503)

    @app.exception_handler(Exception)
    def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("rankscope serve: %s %s failed", request.method, request.url.path)
        return JSONResponse({"detail": one_line(f"{type(exc).__name__}: {exc}")}, status_code=500)

    return app
